"""The entry points of csrc/sampling.c (one row's top-k/top-p distribution and draws) and
csrc/gumbel.c (Gumbel noise keyed by seed, position and token; one row's Gumbel-max pick),
used by selfspec/sampling.py and selfspec/coupling.py."""

from __future__ import annotations

import ctypes

from selfspec.kernels import build
from selfspec.kernels.build import available


_sampling: dict = {}


def sampling_functions() -> dict | None:
    """{"dist": selfspec_sample_dist, "draw": selfspec_sample_draw, "noise": selfspec_gumbel_noise,
    "pick": selfspec_gumbel_pick, "philox": selfspec_philox4x32} as ctypes functions, or None when
    not available()."""
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
            noise = dll.selfspec_gumbel_noise
            noise.restype = None
            noise.argtypes = [ctypes.c_uint64, ctypes.c_int64, p, c_long, p]
            pick = dll.selfspec_gumbel_pick
            pick.restype = c_long
            pick.argtypes = [p, c_long, c_float, c_float, p, ctypes.c_uint64, ctypes.c_int64, p]
            philox = dll.selfspec_philox4x32
            philox.restype = None
            philox.argtypes = [p, p, p]
            _sampling.update(dist=dist, draw=draw, noise=noise, pick=pick, philox=philox)
    return _sampling
