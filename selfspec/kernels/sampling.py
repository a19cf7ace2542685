"""The entry points of csrc/sampling.c: one row's top-k/top-p distribution and draws (used
by selfspec/sampling.py)."""

from __future__ import annotations

import ctypes

from selfspec.kernels import build
from selfspec.kernels.build import available


_sampling: dict = {}


def sampling_functions() -> dict | None:
    """{"dist": selfspec_sample_dist, "draw": selfspec_sample_draw} as ctypes functions, or
    None when not available()."""
    if not available():
        return None
    if not _sampling:
        with build._lock:
            dll = build._blocks["dll"]
            p, c_long, c_float, c_double = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_double
            dist = dll.selfspec_sample_dist
            dist.restype = ctypes.c_int
            dist.argtypes = [p, c_long, c_float, c_long, c_double, c_long, p, p, p, p]
            draw = dll.selfspec_sample_draw
            draw.restype = c_long
            draw.argtypes = [p, c_long, c_float, c_float, c_float, c_double, p,
                             p, p, c_long, c_float, c_float, c_float, c_double, p, c_double, p]
            _sampling.update(dist=dist, draw=draw)
    return _sampling
