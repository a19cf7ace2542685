"""What differs between the supported decoder architectures, as data.

Every supported family is a pre-norm decoder with rotary attention and a gated MLP; the
differences are a handful of switches. `ModelSpec.from_hf_config` reads them from a
transformers config; `weights_from_state_dict` maps HF parameter names onto the runtime's
fused, pre-transposed layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from selfspec.errors import SelfSpecError
from selfspec.kernels.weights import chunk_rows, release_freed

# model_type -> family switches that are not in the config itself.
_FAMILIES: dict[str, dict] = {
    "llama": dict(norm="llama", sandwich_norms=False, qk_norm=False, qkv_bias_key="attention_bias"),
    "mistral": dict(norm="llama", sandwich_norms=False, qk_norm=False, qkv_bias_key=None),
    "qwen2": dict(norm="llama", sandwich_norms=False, qk_norm=False, qkv_bias_key="always"),
    "qwen3": dict(norm="llama", sandwich_norms=False, qk_norm=True, qkv_bias_key="attention_bias"),
    "gemma3_text": dict(norm="gemma", sandwich_norms=True, qk_norm=True, qkv_bias_key="attention_bias"),
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "gelu_new": "gelu_tanh"}


@dataclass(frozen=True)
class ModelSpec:
    """Shape and switches of one decoder, independent of where the weights came from."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    activation: str  # "silu" | "gelu_tanh" | "gelu"
    norm: str  # "llama": w * norm(x); "gemma": (1 + w) * norm(x), all in fp32
    sandwich_norms: bool  # Gemma: extra norms after attention and after the MLP
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    embed_scale: float | None  # Gemma multiplies embeddings by sqrt(hidden)
    attn_scale: float
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention
    rope_kinds: tuple[str, ...]  # per layer: key into the rotary tables ("default" or a layer type)
    final_logit_softcap: float | None
    tie_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = field(default=())

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @staticmethod
    def from_hf_config(config) -> "ModelSpec":
        mt = getattr(config, "model_type", None)
        if mt == "gemma3" and hasattr(config, "text_config"):
            config = config.text_config
            mt = config.model_type
        if mt not in _FAMILIES:
            raise SelfSpecError(
                f"unsupported architecture {mt!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        fam = _FAMILIES[mt]
        n_layers = config.num_hidden_layers
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise SelfSpecError(f"unsupported activation {act!r} in {mt} config")
        bias_key = fam["qkv_bias_key"]
        qkv_bias = bias_key == "always" or bool(bias_key and getattr(config, bias_key, False))
        o_bias = mt != "qwen2" and qkv_bias
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types is not None:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:  # Mistral: one window (or none) for every layer
            windows = tuple(window for _ in range(n_layers))
        rope_params = getattr(config, "rope_parameters", None) or {}
        per_type_rope = layer_types is not None and all(t in rope_params for t in set(layer_types))
        rope_kinds = tuple(layer_types) if per_type_rope else tuple("default" for _ in range(n_layers))
        if getattr(config, "attn_logit_softcapping", None):
            raise SelfSpecError("attention logit soft-capping (Gemma 2) is not supported")
        qpas = getattr(config, "query_pre_attn_scalar", None)
        attn_scale = (qpas if mt.startswith("gemma") and qpas else head_dim) ** -0.5
        eos = getattr(config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return ModelSpec(
            model_type=mt,
            num_layers=n_layers,
            hidden_size=config.hidden_size,
            num_heads=n_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            activation=_ACTIVATIONS[act],
            norm=fam["norm"],
            sandwich_norms=fam["sandwich_norms"],
            qk_norm=fam["qk_norm"],
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            embed_scale=math.sqrt(config.hidden_size) if mt.startswith("gemma") else None,
            attn_scale=attn_scale,
            sliding_windows=windows,
            rope_kinds=rope_kinds,
            final_logit_softcap=getattr(config, "final_logit_softcapping", None),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            eos_token_ids=eos_ids,
        )


def rotary_tables(config, spec: ModelSpec, length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin tables [length, head_dim] (fp32) per rope kind, exactly what the model's own
    transformers rotary module computes for every RoPE variant (llama3, yarn, linear...): its
    frequencies come from the same functions (transformers.modeling_rope_utils), and its forward
    is three elementwise ops, done here the same way. Not importing the modeling module keeps
    transformers' modeling_utils (about a second and 120 MB at every start) out of a load.
    Frequencies that depend on the sequence (dynamic, longrope) are the module's own."""
    if getattr(config, "text_config", None) is not None and spec.model_type == "gemma3_text":
        config = config.text_config
    kinds = sorted(set(spec.rope_kinds))
    params = {k: _rope_params(config, k) for k in kinds}
    factors = getattr(config, "rope_freq_factors", None)  # a GGUF's rope_freqs (gguf_load.config_dict)
    if any(p is None or p.get("rope_type", "default") in _SEQ_DEPENDENT for p in params.values()):
        if factors is not None:
            raise SelfSpecError("a GGUF's rope_freqs with sequence-dependent rope scaling is not supported")
        return _module_tables(config, spec, length)
    pos = torch.arange(length).float()[:, None]  # [T, 1]
    tables = {}
    for kind in kinds:
        inv_freq, scaling = _inv_freq(config, params[kind], None if kind == "default" else kind)
        if factors is not None:  # llama.cpp's rope_freqs: each angle divided by its frequency's factor
            if len(factors) != inv_freq.shape[0]:
                raise SelfSpecError(f"the GGUF's rope_freqs has {len(factors)} factors; its rotary dimension "
                                    f"{2 * inv_freq.shape[0]} needs {inv_freq.shape[0]}")
            inv_freq = inv_freq.float() / torch.tensor(factors, dtype=torch.float32)
        freqs = pos * inv_freq.float()[None]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        tables[kind] = ((emb.cos() * scaling).float(), (emb.sin() * scaling).float())
    return tables


_SEQ_DEPENDENT = ("dynamic", "longrope")  # their modules update the frequencies from the positions


def _rope_params(config, kind: str) -> dict | None:
    p = getattr(config, "rope_parameters", None)
    if kind != "default":  # per layer type (Gemma 3)
        p = p.get(kind) if isinstance(p, dict) else None
    return p if isinstance(p, dict) else None


def _inv_freq(config, params: dict, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2], attention scaling) as the rotary module's __init__ makes them."""
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
    base = params["rope_theta"]  # the modules' compute_default_rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _module_tables(config, spec: ModelSpec, length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The tables from the model's transformers rotary module itself."""
    # only the loaded architecture's modeling module: importing all five costs seconds at every start
    if spec.model_type == "gemma3_text":
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding as Rotary  # see above
    elif spec.model_type == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rotary  # see above
    elif spec.model_type == "qwen2":
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding as Rotary  # see above
    elif spec.model_type == "mistral":
        from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding as Rotary  # see above
    else:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary  # see above
    rotary = Rotary(config)
    pos = torch.arange(length)[None]
    probe = torch.zeros(1, dtype=torch.float32)
    tables = {}
    with torch.no_grad():
        for kind in sorted(set(spec.rope_kinds)):
            cos, sin = rotary(probe, pos, kind) if kind != "default" else rotary(probe, pos)
            tables[kind] = (cos[0].float(), sin[0].float())
    return tables


def _stripped(name: str) -> str:
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name


def strip_prefix(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_stripped(k): v for k, v in sd.items()}


def _plain_matrix(dtype: torch.dtype, device):
    """The torch path's layout of a fused matrix: one [in, sum(out_i)] tensor on `device` (see
    runtime.py), filled a chunk of rows at a time (no second copy of a part, on any device)."""
    def make(parts) -> torch.Tensor:
        out = torch.empty(int(parts[0].shape[1]), sum(int(p.shape[0]) for p in parts), dtype=dtype, device=device)
        col = 0
        step = chunk_rows(4 * out.shape[0])
        for p in parts:
            for r0 in range(0, int(p.shape[0]), step):
                rows = p[r0:r0 + step].to(device=device, dtype=dtype)
                out[:, col:col + rows.shape[0]] = rows.t()
                col += rows.shape[0]
        return out
    return make


def _rows_copy(src, dtype: torch.dtype, device) -> torch.Tensor:
    """A copy of a row source in dtype on device, made a chunk of rows at a time."""
    out = torch.empty(*src.shape, dtype=dtype, device=device)
    step = chunk_rows(4 * out.shape[1])
    for r0 in range(0, int(src.shape[0]), step):
        out[r0:r0 + step] = src[r0:r0 + step]
    return out


def _released(lay):
    """lay(parts), then the chunks it freed handed back to the OS (kernels.weights.release_freed)."""
    def laid(parts):
        w = lay(parts)
        release_freed()
        return w
    return laid


def weights_from_state_dict(spec: ModelSpec, sd: Mapping[str, torch.Tensor], dtype: torch.dtype, device,
                            matrix=None, head_matrix=None) -> dict:
    """HF names -> runtime layout: linear weights transposed to [in, out] (see runtime.py
    for why), q|k|v and gate|up fused into one matrix each (one matmul instead of 3 / 2).

    sd may read tensors on demand (loading.Checkpoint): each is read when its matrix is made
    and dropped after. matrix(parts) lays out one fused matrix from HF's [out_i, in] parts
    (row sources; default: a plain transposed tensor on `device`; the CPU kernels pass
    kernels.pack_parts, which writes their tiles chunk by chunk). The LM head is such a matrix
    too ([H, V]: its rows are the vocabulary), laid out by head_matrix (default: matrix), so
    the largest tensor never has a second copy either."""
    names = {_stripped(k): k for k in sd}
    lazy = getattr(sd, "lazy", None)
    matrix = _released(matrix or _plain_matrix(dtype, device))
    head_matrix = _released(head_matrix) if head_matrix else matrix

    def key(name: str) -> str:
        if name not in names:
            raise SelfSpecError(f"checkpoint is missing tensor {name!r}")
        return names[name]

    def get(name: str) -> torch.Tensor:
        return sd[key(name)]

    def rows(name: str):
        """A row source for the tensor: read a chunk at a time where sd can (a Checkpoint)."""
        return lazy(key(name)) if lazy is not None else sd[key(name)]

    def vec(w: torch.Tensor, norm: bool = False) -> torch.Tensor:
        # Norm weights stay fp32 (both families normalise in fp32); Gemma's (1 + w) is folded in.
        # A copy always: what sd gives may be a view of a file, or the user's own parameter.
        if norm:
            w = w.float() + (1.0 if spec.norm == "gemma" else 0.0)
            return w.to(device)
        return w.to(device=device, dtype=dtype, copy=True)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layer = {
            "wqkv": matrix([rows(a + "q_proj.weight"), rows(a + "k_proj.weight"), rows(a + "v_proj.weight")]),
            "wo": matrix([rows(a + "o_proj.weight")]),
            "w_gate_up": matrix([rows(p + "mlp.gate_proj.weight"), rows(p + "mlp.up_proj.weight")]),
            "w_down": matrix([rows(p + "mlp.down_proj.weight")]),
            "attn_norm": vec(get(p + "input_layernorm.weight"), norm=True),
        }
        if spec.qkv_bias:
            layer["bqkv"] = vec(torch.cat([get(a + "q_proj.bias"), get(a + "k_proj.bias"), get(a + "v_proj.bias")], 0))
        if spec.o_bias:
            layer["bo"] = vec(get(a + "o_proj.bias"))
        if spec.mlp_bias:
            layer["b_gate_up"] = vec(torch.cat([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")], 0))
            layer["b_down"] = vec(get(p + "mlp.down_proj.bias"))
        if spec.qk_norm:
            layer["q_norm"] = vec(get(a + "q_norm.weight"), norm=True)
            layer["k_norm"] = vec(get(a + "k_norm.weight"), norm=True)
        if spec.sandwich_norms:
            layer["post_attn_norm"] = vec(get(p + "post_attention_layernorm.weight"), norm=True)
            layer["mlp_norm"] = vec(get(p + "pre_feedforward_layernorm.weight"), norm=True)
            layer["post_mlp_norm"] = vec(get(p + "post_feedforward_layernorm.weight"), norm=True)
        else:
            layer["mlp_norm"] = vec(get(p + "post_attention_layernorm.weight"), norm=True)
        layers.append(layer)
    tied = spec.tie_embeddings or "lm_head.weight" not in names
    out = {
        "layers": layers,
        "final_norm": vec(get("model.norm.weight"), norm=True),
        "head": head_matrix([rows("model.embed_tokens.weight" if tied else "lm_head.weight")]),  # [H, V]
    }
    # Tied models embed by gathering columns of the head: no second copy of the largest matrix.
    out["embed"] = None if tied else _rows_copy(rows("model.embed_tokens.weight"), dtype, device)  # [V, H]
    return out
