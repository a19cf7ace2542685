"""A GGUF file as a read-on-demand state dict: llama.cpp's tensor names mapped onto the
runtime's (HF) names, each tensor's blocks read and dequantized a chunk of rows at a time when
the runtime lays it out (no float32 model in between, no transformers model at all), the
config built from the file's metadata, and the tokenizer built from it by transformers once
and kept in the cache (converting a 262k-token vocabulary takes long; reloading it does not).

The conversions transformers' own GGUF loader makes are made here too, so a model is the same
either way: llama-architecture files store q and k with their rows permuted for llama.cpp's
rotary layout (undone), and Gemma files store their norms with the +1 folded in (subtracted).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

from selfspec.architectures import ModelSpec
from selfspec.errors import SelfSpecError
from selfspec.gguf_file import GGUFFile, StringArray, TensorInfo
from selfspec.kernels import ggml
from selfspec.kernels.weights import release_freed

# the file's general.architecture -> transformers' model_type
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_PERMUTED_QK = ("llama",)  # llama.cpp's converter permutes q/k rows for these (Mistral is stored as llama)
_TOKENIZER_VERSION = 2  # 2: read back by the generic fast tokenizer, the class's settings in the marker
_KEPT = ("padding_side", "truncation_side", "clean_up_tokenization_spaces", "model_max_length", "chat_template")  # not in tokenizer.json
_MARKER = "selfspec-tokenizer.json"

# per layer: runtime (HF) name -> llama.cpp name
_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_LAYER_LLAMA = {"post_attention_layernorm": "ffn_norm"}
_LAYER_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def architecture(f: GGUFFile) -> str:
    arch = f.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise SelfSpecError(f"{f.path.name}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return arch


def hf_names(f: GGUFFile) -> dict[str, str]:
    """runtime (HF) tensor name -> the file's, for every tensor the runtime reads that the file has."""
    arch = architecture(f)
    per_layer = _LAYER | (_LAYER_GEMMA if arch == "gemma3" else _LAYER_LLAMA)
    out = {}
    for hf, gg in _GLOBAL.items():
        out[hf + ".weight"] = gg + ".weight"
    for i in range(int(f.metadata.get(f"{arch}.block_count", 0))):
        for hf, gg in per_layer.items():
            for kind in ("weight", "bias"):
                out[f"model.layers.{i}.{hf}.{kind}"] = f"blk.{i}.{gg}.{kind}"
    return {hf: gg for hf, gg in out.items() if gg in f.tensors}


def config_dict(f: GGUFFile) -> dict:
    """The transformers config of the file, from its metadata through transformers' own table
    of GGUF keys (GGUF_CONFIG_MAPPING), as its GGUF loader builds it."""
    arch = architecture(f)
    table = GGUF_CONFIG_MAPPING.get(arch, {})
    cfg: dict = {}
    for key, value in f.metadata.items():
        prefix, _, rest = key.partition(".")
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if prefix == arch and table.get(rest) is not None:
            cfg[table[rest]] = value
        elif prefix == "tokenizer" and GGUF_CONFIG_MAPPING["tokenizer"].get(rest) is not None:
            cfg[GGUF_CONFIG_MAPPING["tokenizer"][rest]] = value
    key_length = f.metadata.get(f"{arch}.attention.key_length")
    if key_length is not None:  # the head's width wherever stored (transformers' table reads it for Gemma only)
        cfg["head_dim"] = int(key_length)
    cfg["model_type"] = ARCHITECTURES[arch]
    cfg["tie_word_embeddings"] = "output.weight" not in f.tensors
    cfg.update(_rope_scaling(f, arch))
    if (cap := f.metadata.get(f"{arch}.final_logit_softcapping")) is not None and arch == "gemma3":
        cfg["final_logit_softcapping"] = float(cap)
    if arch == "gemma3" and cfg.get("num_hidden_layers") == 62 and cfg.get("num_attention_heads"):
        # no key holds the query scaling: llama.cpp, as the original Gemma 3 27B, scales by hidden / heads
        # there and by the head width elsewhere (transformers' default, 256, is every other size's width)
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    if (info := f.tensors.get("rope_freqs.weight")) is not None:
        # llama.cpp's per-frequency divisors of the rotary angles: how its converter stores Llama
        # 3.1+'s llama3 rope scaling (no metadata key says it); architectures.rotary_tables applies them
        cfg["rope_freq_factors"] = _dequantized(f.read_rows(info, 0, 1), info).reshape(-1).astype(np.float64).tolist()
    if "vocab_size" not in cfg:
        tokens = f.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, StringArray):
            cfg["vocab_size"] = tokens.count
        elif "token_embd.weight" in f.tensors:
            cfg["vocab_size"] = f.tensors["token_embd.weight"].shape[0]
    return cfg


def _rope_scaling(f: GGUFFile, arch: str) -> dict:
    """The file's rope scaling keys as transformers' config arguments (the inverse of llama.cpp's
    converter, which writes the HF config's rope_scaling as rope.scaling.type / factor / ...;
    transformers' GGUF table reads none of them for these architectures). Without them a Gemma 3
    4B+ file (linear x8 on its global layers) or a long-context Qwen file (yarn) would rotate
    its queries and keys by the wrong angles. As llama.cpp reads them: a factor with no type is
    linear (the older key rope.scale_linear too), type none scales nothing; Gemma 3's scaling is
    its global layers' (transformers applies rope_scaling there, llama.cpp's SWA layers keep scale
    1), and its local layers' base may be stored as rope.freq_base_swa."""
    def key(name: str):
        return f.metadata.get(f"{arch}.rope.{name}")

    out: dict = {}
    if arch == "gemma3" and (base := key("freq_base_swa")) is not None:
        out["rope_local_base_freq"] = float(base)
    factor = key("scaling.factor")
    factor = float(factor if factor is not None else key("scale_linear") or 0.0)
    kind = str(key("scaling.type") or "linear")
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
        return out
    where = f"{f.path.name}: rope scaling {kind!r}"
    if kind not in ("linear", "yarn"):
        raise SelfSpecError(f"{where} is not supported (supported: linear, yarn)")
    if factor <= 0.0:
        raise SelfSpecError(f"{where} needs a positive rope.scaling.factor, got {factor}")
    scaling = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        ext, log_mul = key("scaling.yarn_ext_factor"), key("scaling.yarn_log_multiplier")
        if (ext is not None and float(ext) != 1.0) or (log_mul is not None and float(log_mul) != 0.0):
            raise SelfSpecError(f"{where} with yarn_ext_factor or yarn_log_multiplier is not supported")
        orig = key("scaling.original_context_length") or f.metadata.get(f"{arch}.context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        for gg, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"), ("yarn_attn_factor", "attention_factor")):
            if (value := key(f"scaling.{gg}")) is not None:
                scaling[hf] = float(value)
    out["rope_scaling"] = scaling
    return out


def hf_config(f: GGUFFile):
    cfg = config_dict(f)
    try:
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    except Exception as e:  # transformers raises many types for inconsistent values
        raise SelfSpecError(f"{f.path.name}: cannot build a config from its metadata: {str(e).splitlines()[0]}") from e


def _dequantized(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """Raw blocks [m, row_bytes] -> float32 [m, cols] (the gguf package's dequantizer's bits)."""
    return ggml.dequantize(raw, info.qtype, info.shape[-1])


def _qk_order(rows: int, heads: int) -> np.ndarray:
    """Which stored row each HF row is: llama.cpp interleaved the two rotary halves of each head
    (HF row h*2d + i*d + j was stored at h*2d + 2j + i)."""
    d = rows // heads // 2
    return np.arange(rows).reshape(heads, d, 2).transpose(0, 2, 1).reshape(-1)


class GGUFRows:
    """One matrix of the file as a row source (what kernels.pack_parts reads): .shape [out, in],
    and [a:b] dequantizes rows a..b-1 to float32, reading only their blocks."""

    __slots__ = ("_file", "_info", "_order", "shape")

    def __init__(self, file: GGUFFile, info: TensorInfo, order: np.ndarray | None):
        self._file, self._info, self._order = file, info, order
        self.shape = torch.Size(info.shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        a, b, _ = rows.indices(self.shape[0])
        if b <= a:
            return torch.empty(0, self.shape[1])
        if self._order is None:
            raw = self._file.read_rows(self._info, a, b)
        else:  # the stored rows of a permuted slice lie within the heads it covers
            want = self._order[a:b]
            lo, hi = int(want.min()), int(want.max()) + 1
            raw = self._file.read_rows(self._info, lo, hi)[want - lo]
        return torch.from_numpy(np.ascontiguousarray(_dequantized(raw, self._info)))


class GGUFCheckpoint(Mapping):
    """A GGUF file as a state dict under the runtime's (HF) names: [name] reads and dequantizes
    the whole tensor (norms, biases), lazy(name) gives a GGUFRows that reads a chunk at a time."""

    def __init__(self, file: GGUFFile):
        self.file = file
        self.arch = architecture(file)
        self._names = hf_names(file)
        md = file.metadata
        heads = int(md.get(f"{self.arch}.attention.head_count", 0))
        kv_heads = int(md.get(f"{self.arch}.attention.head_count_kv", heads) or heads)
        self._heads = {"q_proj": heads, "k_proj": kv_heads} if self.arch in _PERMUTED_QK else {}

    def _order(self, name: str, rows: int) -> np.ndarray | None:
        for proj, heads in self._heads.items():
            if f".self_attn.{proj}." in name:
                return _qk_order(rows, heads)
        return None

    def _info(self, name: str) -> TensorInfo:
        return self.file.tensors[self._names[name]]

    def __getitem__(self, name: str) -> torch.Tensor:
        info = self._info(name)
        if len(info.shape) == 1:
            w = _dequantized(self.file.read_rows(info, 0, 1), info).reshape(-1)
            order = self._order(name, w.shape[0])
            w = w[order] if order is not None else w
            if self.arch == "gemma3" and name.endswith("norm.weight"):
                w = w - 1  # stored with Gemma's +1 folded in (the runtime adds it back, as for HF weights)
            return torch.from_numpy(np.array(w, dtype=np.float32))
        return self.lazy(name)[:]

    def check_shapes(self, spec: ModelSpec) -> None:
        """One line where a tensor's shape is not the one the metadata gives it (the kernels
        would read past its end), or a tensor the runtime needs is missing."""
        h, q, kv, ffn = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
        want = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                "self_attn.o_proj": (h, q), "mlp.gate_proj": (ffn, h), "mlp.up_proj": (ffn, h), "mlp.down_proj": (h, ffn),
                "self_attn.q_norm": (spec.head_dim,), "self_attn.k_norm": (spec.head_dim,)}
        for name, gg in self._names.items():
            stem = name.removesuffix(".weight").removesuffix(".bias")
            if name.startswith(("model.embed_tokens.", "lm_head.")):
                shape = (spec.vocab_size, h)
            elif stem.startswith("model.layers."):
                part = stem.split(".", 3)[3]
                shape = want.get(part, (h,))[:1 if name.endswith(".bias") else 2]
            else:
                shape = (h,)
            if self.file.tensors[gg].shape != shape:
                raise SelfSpecError(f"{self.file.path.name}: tensor {gg} is {list(self.file.tensors[gg].shape)}, "
                                    f"its metadata makes it {list(shape)}")
        if "model.embed_tokens.weight" not in self._names:
            raise SelfSpecError(f"{self.file.path.name}: no token_embd.weight tensor")

    def block_info(self, name: str) -> TensorInfo:
        """The file's record of the tensor under runtime name `name` (its block type and shape)."""
        return self._info(name)

    def blocks(self, name: str) -> tuple[np.ndarray, object]:
        """(uint8 [rows, row_bytes], block type): the matrix's blocks as stored, rows in the
        runtime's order (llama's q/k permutation undone a whole row at a time): a read-only view
        of the mapped file (GGUFFile.mapped_rows), or a copy where rows are reordered."""
        info = self._info(name)
        raw = self.file.mapped_rows(info)
        order = self._order(name, info.shape[0])
        return (raw if order is None else np.ascontiguousarray(raw[order])), info.qtype

    def lazy(self, name: str) -> GGUFRows:
        info = self._info(name)
        return GGUFRows(self.file, info, self._order(name, info.shape[0]))

    def __contains__(self, name) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# ---- the tokenizer, converted once ----------------------------------------------------------

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="selfspec-gguf-tokenizer")


def _header_key(f: GGUFFile) -> str:
    """The file's metadata and tensor records, hashed: the tokenizer's identity (not its path)."""
    h = hashlib.sha256()
    with open(f.path, "rb") as fh:
        h.update(fh.read(f.header_bytes()))
    return h.hexdigest()[:20]


def tokenizer_dir(f: GGUFFile, cache: Path) -> Path:
    return cache / "gguf-tokenizers" / _header_key(f)


def _cached_init(d: Path) -> dict | None:
    """The converted tokenizer's own settings where `d` holds one of this version, else None."""
    try:
        marker = json.loads((d / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker.get("init") if isinstance(marker, dict) and marker.get("version") == _TOKENIZER_VERSION else None


def load_tokenizer(path: Path, d: Path):
    """The file's tokenizer (and chat template), from the cache where converted before: its
    tokenizer.json (the whole pipeline, as the converted class saved it) read by the generic
    fast tokenizer, with the settings the class set kept in the marker. The converted class
    (GemmaTokenizer, ...) would rebuild its model from the vocabulary and merges in Python,
    which for a 262k vocabulary doubles the memory and the time of the load."""
    try:
        if (init := _cached_init(d)) is not None:  # the constructor: from_pretrained costs as much again
            tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), **init)
            release_freed()  # its parse's heap, freed, back to the OS now: the weights load meanwhile (the peak)
            return tok
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad file or cache
        raise SelfSpecError(f"cannot load the tokenizer of {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    tmp = None
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.tmp-", dir=d.parent))
        tok.save_pretrained(str(tmp))
        init = {**{k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)},
                **{k: getattr(tok, k) for k in _KEPT if getattr(tok, k, None) is not None}}
        (tmp / _MARKER).write_text(json.dumps({"version": _TOKENIZER_VERSION, "source": str(path), "init": init}))
        if d.exists():
            shutil.rmtree(d)
        os.replace(tmp, d)
    except OSError:  # a read-only cache: convert again next time
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def load(path: Path, cache: Path, tokenizer=None):
    """-> (GGUFCheckpoint, hf_config, tokenizer or a future of it). Reads the header only."""
    f = GGUFFile(path)
    sd = GGUFCheckpoint(f)
    config = hf_config(f)
    sd.check_shapes(ModelSpec.from_hf_config(config))  # unsupported or inconsistent files fail before any weight is read
    if tokenizer is None:
        tokenizer = _POOL.submit(load_tokenizer, path, tokenizer_dir(f, cache))
    return sd, config, tokenizer


def shape(path: Path) -> tuple[int, int] | None:
    """(num_layers, vocab_size) of a GGUF file from its header; None where it cannot be read."""
    try:
        cfg = config_dict(GGUFFile(path))
        return int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    except (SelfSpecError, KeyError, TypeError, ValueError):
        return None
