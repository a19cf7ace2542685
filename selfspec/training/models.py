"""The trainable transformers model: built from a preset or a config file (from scratch), or
loaded from a HF directory / built-in alias (continual training), and saved as a
HF-compatible safetensors directory that `selfspec.load(dir)` reads.

Presets are small Llama shapes that train at a useful speed on a CPU; the vocabulary size
comes from the tokenizer. Configs are always fresh objects built here (a copy when loading),
so a caller's config is never mutated.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from selfspec.architectures import ModelSpec, strip_prefix
from selfspec.errors import SelfSpecError
from selfspec.loading import load_source, resolve_tokenizer

# name -> LlamaConfig fields (vocab_size, eos/bos and max_position_embeddings are added).
PRESETS: dict[str, dict] = {
    # for tests and smoke runs: 4 layers, hidden 64
    "llama-tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    # ~10M parameters in the layers: the demo's size on a 2-core CPU
    "llama-12l": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=4),
    # ~28M parameters in the layers
    "llama-16l": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=6, num_key_value_heads=2),
}
PRESET_CONTEXT = 2048
ATTENTION = "sdpa"  # training attention kernel: fused causal attention when no sliding window applies


def preset_config(name: str, tokenizer):
    if name not in PRESETS:
        raise SelfSpecError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    eos = tokenizer.eos_token_id
    bos = getattr(tokenizer, "bos_token_id", None)
    return LlamaConfig(
        **PRESETS[name],
        vocab_size=len(tokenizer),
        max_position_embeddings=PRESET_CONTEXT,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=None,
    )


def file_config(path: str, tokenizer):
    p = Path(path).expanduser()
    try:
        d = json.loads(p.read_text())
        if not isinstance(d, dict) or "model_type" not in d:
            raise ValueError("no model_type")
        config = AutoConfig.for_model(**d)
    except FileNotFoundError as e:
        raise SelfSpecError(f"config not found: {path}") from e
    except Exception as e:  # JSON errors, unknown model types, bad fields
        raise SelfSpecError(f"cannot read the model config {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    ModelSpec.from_hf_config(config)  # supported architecture?
    if config.vocab_size < len(tokenizer):
        raise SelfSpecError(f"{path} has vocab_size {config.vocab_size}, but the tokenizer has {len(tokenizer)} tokens")
    return config


def new_model(config, seed: int) -> torch.nn.Module:
    """A freshly initialised causal LM (fp32) for `config` (copied, never modified)."""
    config = copy.deepcopy(config)
    config._attn_implementation = ATTENTION
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def load_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], where: str) -> None:
    """Copy weights in; the only key allowed to be missing is a tied LM head."""
    sd = strip_prefix(state_dict)
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise SelfSpecError(f"the weights in {where} do not fit the model ({what})")


def load_pretrained(source: str):
    """A HF directory or a built-in alias -> (model, tokenizer, name). Weights come through
    selfspec.loading (the same converted cache `selfspec.load` uses)."""
    sd, config, tok, name = load_source(source)
    tok = resolve_tokenizer(tok)
    if tok is None:
        raise SelfSpecError(f"{source} has no tokenizer: training needs one to read text")
    ModelSpec.from_hf_config(config)
    if getattr(config, "model_type", None) == "gemma3" and hasattr(config, "text_config"):
        raise SelfSpecError("multimodal Gemma 3 checkpoints are not supported for training; use a text-only (gemma3_text) model")
    model = new_model(config, seed=0)
    load_weights(model, sd, str(source))
    return model, tok, name


def save_model_dir(model: torch.nn.Module, tokenizer, target: Path) -> None:
    """config.json + model.safetensors (+ generation_config.json) + tokenizer files into
    `target` (an existing, empty directory: callers build it under a temporary name)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(target))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(target))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(target))


def read_model_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    try:
        sd: dict[str, torch.Tensor] = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            sd.update(load_file(str(f)))
    except Exception as e:
        raise SelfSpecError(f"corrupt weights in checkpoint {ckpt}: {e}") from e
    if not sd:
        raise SelfSpecError(f"checkpoint {ckpt} has no weights")
    return sd


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, parameters outside the embedding / LM head)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    outside = total - embed.numel() - (0 if head is embed else head.numel())
    return total, outside
