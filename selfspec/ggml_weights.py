"""A GGUF file's own quantization, run as stored: the runtime's matrices are GGMLWeights (its
rows of blocks, kernels/ggml_gemm.py), the embedding a lookup that dequantizes only the rows it
reads, the LM head (tied or not) the same blocks multiplied natively. Activations, the
residual stream and the KV cache are fp32 (the fused blocks' fp32 mode), as llama.cpp keeps
its activations.

`--dtype auto` (the default for a .gguf source) runs a file this way where every matrix is in
a block type the kernels multiply and the CPU kernels are here; otherwise, and for
`--dtype bfloat16` / `float32`, the file is dequantized at load as before (gguf_load.py).

What cannot run over blocks yet falls back, never computing something else:
  * the greedy head's int8 screen: not made (the full native head decides every argmax);
  * the fused draft step (Runtime.step_token): not used (the drafters' per-layer path);
  * a `quantized` draft: an int4 copy of the dequantized layers only (int8 would read more
    bytes than the blocks it drafts for: refused with one line).
"""

from __future__ import annotations

import torch

from selfspec import kernels
from selfspec.errors import SelfSpecError
from selfspec.gguf_load import GGUFCheckpoint
from selfspec.kernels.ggml_gemm import GGMLWeight, why_not
from selfspec.runtime import Runtime

AUTO = ("auto", None)
_PARTS = {"wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "wo": ("self_attn.o_proj",),
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
    if any(name.endswith(".bias") for name in sd):
        return "biases are not run natively yet"
    return None


def runtime(spec, sd, config, dtype, torch_dtype: torch.dtype, device: str) -> Runtime:
    """The runtime of a loaded source: native blocks for a GGUF under --dtype auto where it can
    (GGMLRuntime), else Runtime.from_state_dict in torch_dtype."""
    if dtype in AUTO and native_reason(sd, device) is None:
        return GGMLRuntime.from_gguf(spec, sd, config)
    return Runtime.from_state_dict(spec, sd, config, torch_dtype, device)


def _blocks(sd: GGUFCheckpoint, names: list[str]) -> GGMLWeight:
    parts = [sd.blocks(n) for n in names]
    return GGMLWeight(parts, sd.block_info(names[0]).shape[1])


class GGMLRuntime(Runtime):
    """Runtime over a GGUF file's blocks (module doc)."""

    draft_bits = (4,)  # quantized draft copies it makes (drafters.factory.runs_here)

    @classmethod
    def from_gguf(cls, spec, sd: GGUFCheckpoint, config) -> "GGMLRuntime":
        vec = lambda n, norm=True: sd[n].float() + (1.0 if spec.norm == "gemma" and norm else 0.0)  # noqa: E731
        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            L = {k: _blocks(sd, [f"{p}{part}.weight" for part in parts]) for k, parts in _PARTS.items()}
            L["attn_norm"] = vec(p + "input_layernorm.weight")
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
            raise SelfSpecError(f"an int{bits} draft copy of a GGUF run natively would read more bytes than its own "
                                "blocks; use an int4 copy (draft_bits=4) or --dtype bfloat16")
        return super().quantized(bits, *args, **kwargs)
