"""How many threads the kernels use, and keeping torch's own threads out of their way.

The kernels run on their own thread pool (csrc/pool.c), the same workers whichever thread
calls them. torch runs its intra-op parallel ops (a logits row's fill or argmax, 262k
entries) on OpenMP threads of its own, which spin for milliseconds after each op: inside a
generation they would fight the kernels' workers for the same cores (a decode step
measured far slower on 2 cores). So a generation runs inside `compute_scope()`: the kernels
get the thread count torch had (`threads()`), and torch runs single-threaded in this thread
until the scope ends (torch.set_num_threads is per calling thread under OpenMP; it is
restored on exit). Outside a scope the kernels use torch.get_num_threads().
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_local = threading.local()


def threads() -> int:
    """Threads a kernel call uses now: the scope's count, else torch's."""
    n = getattr(_local, "n", None)
    return n if n is not None else torch.get_num_threads()


@contextmanager
def compute_scope() -> Iterator[int]:
    """Kernels on threads() threads, torch on one, in this thread (module doc); re-entrant.
    Yields the kernels' thread count."""
    outer = getattr(_local, "n", None)
    if outer is not None:
        yield outer
        return
    n = torch.get_num_threads()
    _local.n = n
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield n
    finally:
        if n > 1:
            torch.set_num_threads(n)
        _local.n = None
