"""A GGUF file's own quantization, run as stored: the runtime's matrices are GGMLWeights (its
rows of blocks, kernels/ggml_gemm.py), the embedding a lookup that dequantizes only the rows it
reads, the LM head (tied or not) the same blocks multiplied natively. Activations, the
residual stream and the KV cache are fp32 (the fused blocks' fp32 mode), as llama.cpp keeps
its activations.

`--dtype native` runs a file this way where every matrix is in a block type the kernels multiply
and the CPU kernels are here (else one line says why not). `--dtype auto` (the default) runs a
GGUF's blocks where its bf16 copy would take more than NATIVE_ABOVE bytes (1B models and up: as
fast or faster autoregressively, loaded in a tenth of the time and a third of the memory) or would
not fit, and dequantizes smaller files to bfloat16, where the speculative step is cheaper (the
default model: benchmarks/models/vs_llama_bench.py, benchmarks/RESULTS.md); where the blocks
cannot run here, auto dequantizes them if that fits.
What cannot run over blocks yet falls back, never computing something else:
  * the greedy head's int8 screen: not made (the full native head decides every argmax);
  * the fused draft step (Runtime.step_token): not used (the drafters' per-layer path);
  * a `quantized` draft: an int4 copy of the dequantized layers only (int8 would read more
    bytes than the blocks it drafts for: refused with one line), int8 too over F16 / BF16 layers.
"""

from __future__ import annotations

import os

import torch

from selfspec import kernels
from selfspec.errors import SelfSpecError
from selfspec.gguf_load import GGUFCheckpoint
from selfspec.kernels.ggml_gemm import GGMLWeight, why_not
from selfspec.loading import check_fits, runtime_bytes
from selfspec.runtime import Runtime

AUTO = ("auto", None)
NATIVE = "native"
AUTO_NATIVE = "auto-native"  # auto's choice of the blocks by size: dequantized instead where they cannot run here
NATIVE_ABOVE = 1 << 30  # bf16 bytes above which auto runs a GGUF's blocks (module doc)
Q8_0_BYTES = 34 / 32  # bytes per weight of Q8_0, the widest block type run natively (fits-checks size by it)
_PARTS_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_BIASES = {"qkv_bias": {"bqkv": _PARTS_QKV}, "o_bias": {"bo": ("self_attn.o_proj",)},
           "mlp_bias": {"b_gate_up": ("mlp.gate_proj", "mlp.up_proj"), "b_down": ("mlp.down_proj",)}}
_PARTS = {"wqkv": _PARTS_QKV, "wo": ("self_attn.o_proj",),
          "w_gate_up": ("mlp.gate_proj", "mlp.up_proj"), "w_down": ("mlp.down_proj",)}


def native_reason(sd, device: str) -> str | None:
    """None where `sd` (a checkpoint) can run its own blocks here, else why not, in words."""
    if not isinstance(sd, GGUFCheckpoint):
        return "not a GGUF file"
    if str(device) != "cpu":
        return f"the model is on {device}"
    if not kernels.available():
        return f"selfspec's CPU kernels are unavailable ({kernels.load_error() or 'disabled'})"
    for name in sd:
        if name.endswith(".weight") and not name.endswith("norm.weight"):
            info = sd.block_info(name)
            if len(info.shape) == 2:
                why = why_not(info.qtype, info.shape[1])
                if why:
                    return f"{info.name}: {why}"
    return None


def is_gguf(source) -> bool:
    """Whether a load source names a GGUF file (a path, or a Hub id's `:file.gguf`)."""
    return isinstance(source, (str, os.PathLike)) and str(source).lower().endswith(".gguf")


def native_bytes(spec) -> int:
    """Bytes a GGUF's blocks take at most in memory (every matrix sized as Q8_0: the quantized files
    this check is for; an F16 / BF16 file's mapped pages take twice that, read-only page cache)."""
    return int(runtime_bytes(spec, torch.int8) * Q8_0_BYTES)


def fitting(source, dtype, spec, torch_dtype: torch.dtype, device: str):
    """What a model's weights will run as, decided from its config before any is read: `dtype`,
    NATIVE where auto's dequantized copy of a GGUF cannot fit but its blocks can, AUTO_NATIVE
    where it fits but is above NATIVE_ABOVE (the blocks, or the copy where they cannot run); a
    one-line SelfSpecError (loading.check_fits) where nothing fits."""
    if dtype == NATIVE:
        check_fits(native_bytes(spec), device, f"{source} on its own blocks")
        return dtype
    screened = str(device) == "cpu" and kernels.available() and not spec.final_logit_softcap
    try:
        check_fits(runtime_bytes(spec, torch_dtype, screened), device, f"{source} in {str(torch_dtype).removeprefix('torch.')}")
    except SelfSpecError:
        if dtype not in AUTO or not is_gguf(source):
            raise
        check_fits(native_bytes(spec), device, f"{source} (even on its own blocks)")
        return NATIVE
    if dtype in AUTO and is_gguf(source) and runtime_bytes(spec, torch.bfloat16) > NATIVE_ABOVE:
        return AUTO_NATIVE  # runtime() dequantizes where native_reason says the blocks cannot run (a GPU, no kernels)
    return dtype


def runtime(spec, sd, config, dtype, torch_dtype: torch.dtype, device: str) -> Runtime:
    """The runtime of a loaded source: a GGUF's own blocks under --dtype native (GGMLRuntime),
    else Runtime.from_state_dict in torch_dtype."""
    if dtype in (NATIVE, AUTO_NATIVE):
        if (why := native_reason(sd, device)) is None:
            return GGMLRuntime.from_gguf(spec, sd, config)
        if dtype == NATIVE:
            raise SelfSpecError(f"this model's blocks cannot run as stored here ({why}); --dtype bfloat16 dequantizes them")
    return Runtime.from_state_dict(spec, sd, config, torch_dtype, device)  # (AUTO_NATIVE: fitting checked this fits)


def weight_columns(rt: Runtime, i: int, name: str, n: int) -> torch.Tensor:
    """The first n columns of rt.weight(i, name): [in, n], over blocks without dequantizing the rest
    (a probe: model.fingerprint)."""
    w = rt.layers[i][name]
    return w.columns(torch.arange(min(n, w.out_features))) if isinstance(w, GGMLWeight) else rt.weight(i, name)[:, :n]


def _blocks(sd: GGUFCheckpoint, names: list[str]) -> GGMLWeight:
    parts = [sd.blocks(n) for n in names]
    # the products read a packed copy: the mapped pages it was made from need not stay (the peak)
    return GGMLWeight(parts, sd.block_info(names[0]).shape[1], lambda i, a, b: sd.file.drop_pages(sd.block_info(names[i]), a, b))


class GGMLRuntime(Runtime):
    """Runtime over a GGUF file's blocks (module doc)."""

    draft_bits = (4,)  # quantized draft copies it makes (drafters.factory.runs_here); F16 / BF16 layers: 8 too

    @classmethod
    def from_gguf(cls, spec, sd: GGUFCheckpoint, config) -> "GGMLRuntime":
        vec = lambda n, norm=True: sd[n].float() + (1.0 if spec.norm == "gemma" and norm else 0.0)  # noqa: E731
        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            L = {k: _blocks(sd, [f"{p}{part}.weight" for part in parts]) for k, parts in _PARTS.items()}
            L["attn_norm"] = vec(p + "input_layernorm.weight")
            for key, names in _BIASES.items():  # fp32, added to the blocks' fp32 outputs (csrc/blocks.c)
                if getattr(spec, key):
                    for k, parts in names.items():
                        L[k] = torch.cat([vec(f"{p}{part}.bias", norm=False) for part in parts])
            if spec.qk_norm:
                L["q_norm"], L["k_norm"] = vec(p + "self_attn.q_norm.weight"), vec(p + "self_attn.k_norm.weight")
            if spec.sandwich_norms:
                L["post_attn_norm"] = vec(p + "post_attention_layernorm.weight")
                L["mlp_norm"] = vec(p + "pre_feedforward_layernorm.weight")
                L["post_mlp_norm"] = vec(p + "post_feedforward_layernorm.weight")
            else:
                L["mlp_norm"] = vec(p + "post_attention_layernorm.weight")
            layers.append(L)
        tied = spec.tie_embeddings or "lm_head.weight" not in sd
        head = _blocks(sd, ["model.embed_tokens.weight" if tied else "lm_head.weight"])
        embed = None if tied else _blocks(sd, ["model.embed_tokens.weight"])
        weights = {"layers": layers, "final_norm": vec("model.norm.weight"), "head": head, "embed": embed}
        return cls(spec, weights, config, torch.float32, torch.device("cpu"))

    def __init__(self, spec, weights, hf_config, dtype, device):
        super().__init__(spec, weights, hf_config, dtype, device)
        self.numerics = "cpu-ggml"
        full = all(q in ("F16", "BF16") for L in self.layers for w in L.values() if isinstance(w, GGMLWeight) for q in w.qtypes)
        self.draft_bits = (4, 8) if full else (4,)  # a copy must read fewer bytes than the blocks it drafts for
        self._screened = None  # greedy_head.screened_head: no int8 screen over blocks (the full head decides)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        src = self.embed_weight if self.embed_weight is not None else self.head
        h = src.rows(ids)
        if self._embed_scale is not None:
            h = h * self._embed_scale
        return h.contiguous()

    def head_weight(self) -> torch.Tensor:
        return self.head.dequantize()

    def head_columns(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.columns(ids)

    def head_blocks(self, ids: torch.Tensor) -> GGMLWeight:
        """The LM head's columns `ids` as their own blocks (a restricted draft head: the same
        chains as the full head's columns, a fraction of its bytes)."""
        (raw, qtype), = self.head.parts  # the head is one tensor of the file
        return GGMLWeight([(raw[ids.reshape(-1).cpu().numpy()], qtype)], self.head.in_features)

    def weight(self, i: int, name: str) -> torch.Tensor:
        w = self.layers[i][name]
        return w.dequantize() if isinstance(w, GGMLWeight) else w

    def step_token(self, *args, **kwargs):
        return None  # the fused draft step reads a bf16/fp32 embedding: the per-layer path instead

    def quantized(self, bits: int, *args, **kwargs) -> Runtime:
        if bits not in self.draft_bits:
            raise SelfSpecError(f"an int{bits} draft copy of this GGUF run natively would read more bytes than its own "
                                "blocks; use an int4 copy (draft_bits=4) or --dtype bfloat16")
        return super().quantized(bits, *args, **kwargs)
