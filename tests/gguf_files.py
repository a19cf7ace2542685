"""Small GGUF files written by the tests themselves (gguf's GGUFWriter) from tiny random HF
models, laid out as llama.cpp's converter lays them out: its tensor names, q/k rows permuted
for llama-architecture files, Gemma's norms stored with +1, matrices in a chosen block type."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM

# tiny HF arch -> the file's general.architecture
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_LLAMA = {"post_attention_layernorm": "ffn_norm"}
_GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
          "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(hf: str, gemma: bool) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    stem, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{(_LAYER | (_GEMMA if gemma else _LLAMA))[stem]}.{kind}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# byte offsets of each block's fp16 scales (random blocks: any other bytes are a valid block)
_Q = gguf.GGMLQuantizationType
_HALVES = {_Q.Q4_1: (0, 2), _Q.Q5_1: (0, 2), _Q.Q2_K: (80, 82), _Q.Q4_K: (0, 2), _Q.Q5_K: (0, 2), _Q.Q6_K: (208,)}
_RANDOM = (_Q.Q2_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K, _Q.IQ4_NL, _Q.IQ4_XS)  # what write_gguf stores as random blocks: gguf cannot quantize to them


def random_blocks(qtype, rows: int, cols: int, seed: int, scale: float = 0.004) -> np.ndarray:
    """uint8 [rows, row_bytes]: random blocks of qtype whose fp16 scales are in (0, scale]
    (the gguf package cannot quantize to K-quants: tests of them run random blocks)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _HALVES.get(qtype, (0,)):
        s = (rng.random((rows, cols // block)) * scale + scale / 64).astype(np.float16)
        raw[..., off:off + 2] = s[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def llama3_rope_factors(rope: dict, dim: int) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs for llama3 rope scaling: per frequency the
    divisor of its angle, 1 for wavelengths under original / high_freq_factor, `factor` above
    original / low_freq_factor, and in between the inverse of the blend transformers applies to
    inv_freq ((1 - s) / factor + s, s linear in original / wavelength)."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    out = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def write_gguf(hf_model, path: Path, matrix_type=gguf.GGMLQuantizationType.Q8_0, block_types: dict | None = None) -> Path:
    """hf_model (a tiny transformers causal LM) as a GGUF file at path; norms F32, matrices
    (and the embedding) in matrix_type, or block_types[<llama.cpp name>] (e.g. "ffn_down",
    "token_embd") for the matrices it names: K-quants as random blocks (random_blocks), the
    others quantized from the model's weights. Returns path."""
    cfg = hf_model.config
    arch = GGUF_ARCH[cfg.model_type.removesuffix("_text")]
    gemma = arch == "gemma3"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters if isinstance(getattr(cfg, "rope_parameters", None), dict) else {}
    w.add_rope_freq_base(float(rope.get("full_attention", rope).get("rope_theta", 10000.0)))  # Gemma 3: its global layers'
    scaling = rope.get("full_attention", rope)
    if scaling.get("rope_type") in ("linear", "yarn"):  # as the converter writes them (conversion/base.py)
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        w.add_rope_scaling_factor(scaling["factor"])
        if scaling["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast), ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
                             ("attention_factor", w.add_rope_scaling_yarn_attn_factor)):
                if scaling.get(key) is not None:
                    add(scaling[key])
    if arch == "llama" and rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):
            a = a + 1
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            a = _permute(a, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        gname = _gguf_name(name, gemma)
        qt = next((t for k, t in (block_types or {}).items() if gname.split(".")[-2] == k), matrix_type)
        if a.ndim == 2 and qt in _RANDOM:
            w.add_tensor(gname, random_blocks(qt, a.shape[0], a.shape[1], seed=sum(map(ord, gname))), raw_dtype=qt)
        elif a.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def transformers_model(path: Path):
    """transformers' own reading of the file (its GGUF loader), fp32."""
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True)
    return m.eval()
