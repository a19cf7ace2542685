"""Quantized copies kept on disk: a model's int8/int4 draft copy is made once per machine
(selfspec/quant.py, about a second per 100M weights) and read back on later loads (a fraction of a
second), as the converted default model is. One safetensors file per copy, written to a
temporary file and renamed; a file made by other quantizer code, for other weights or a
dtype, or that does not read back whole is ignored and remade."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from selfspec.kernels import QuantizedWeight
from selfspec.loading import cache_root

_SOURCES = [Path(__file__).with_name("quant.py"), Path(__file__).parent / "csrc" / "quant.c"]


def quantizer_version() -> str:
    """A hash of the quantizers' code: what they make changes with it."""
    h = hashlib.sha256()
    for p in _SOURCES:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def store_path(fingerprint: str, dtype: torch.dtype, what: str) -> Path:
    """what: e.g. "layers-int8", "head-16384-int8"."""
    root = Path(os.environ.get("SELFSPEC_QUANT_DIR") or cache_root() / "quantized")
    return root / f"{fingerprint}-{str(dtype).removeprefix('torch.')}-{what}.safetensors"


def save_weights(path: Path, weights: dict[str, QuantizedWeight]) -> None:
    tensors, meta = {}, {"version": quantizer_version()}
    for name, w in weights.items():
        tensors[f"{name}.q"] = w.q
        tensors[f"{name}.scale"] = w.scale
        if w.zero is not None:
            tensors[f"{name}.zero"] = w.zero
        meta[name] = f"{w.in_features},{w.out_features},{w.bits},{w.group}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_weights(path: Path, device: torch.device | str = "cpu") -> dict[str, QuantizedWeight] | None:
    """The weights save_weights wrote, or None (no file, another quantizer version, unreadable)."""
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            if meta.get("version") != quantizer_version():
                return None
            out = {}
            for name, dims in meta.items():
                if name == "version":
                    continue
                k, n, bits, group = map(int, dims.split(","))
                zero = f.get_tensor(f"{name}.zero") if bits == 4 else None
                out[name] = QuantizedWeight(f.get_tensor(f"{name}.q"), f.get_tensor(f"{name}.scale"), zero, k, n, bits, group)
            return out
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError):  # missing, truncated, not safetensors
        return None
