"""Data parallelism under `torchrun --nproc-per-node N` (gloo on the CPU, nccl on CUDA).

Every rank holds the whole model and all the data; the global batch of a micro-step is
split into contiguous row blocks, one per rank. Gradients are summed over ranks once per
optimizer step (after gradient accumulation), so with losses normalised by the *global*
number of target tokens the update equals a single process's on the same global batch.
We run the decoder layers ourselves (see layerskip.py), so instead of wrapping the model in
DistributedDataParallel (which hooks `module.forward`) the gradients are all-reduced
explicitly in one flattened buffer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from selfspec.errors import SelfSpecError


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, rows: int) -> tuple[int, int]:
        """This rank's [start, end) of `rows` global rows (rows must divide evenly)."""
        per = rows // self.world
        return self.rank * per, (self.rank + 1) * per


def init(device: str | None) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1), else a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want_cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    if want_cuda and not torch.cuda.is_available():
        raise SelfSpecError("--device cuda requested but no CUDA GPU is available")
    if world <= 1:
        return Dist(0, 1, (device or "cuda") if want_cuda else "cpu")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if want_cuda else "gloo")
    if want_cuda:
        torch.cuda.set_device(local)
    return Dist(rank, world, f"cuda:{local}" if want_cuda else "cpu")


def shutdown(d: Dist) -> None:
    if d.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(d: Dist, t: torch.Tensor) -> torch.Tensor:
    if d.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(d: Dist, flag: bool) -> bool:
    """True on every rank when `flag` is true on any (time budgets, Ctrl-C): ranks stop together."""
    if d.world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def broadcast_object(d: Dist, obj):
    """Rank 0's `obj` on every rank (picklable objects)."""
    if d.world == 1:
        return obj
    box = [obj if d.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_parameters(d: Dist, params) -> None:
    """Start every rank from rank 0's weights (as DistributedDataParallel does)."""
    if d.world == 1:
        return
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


def sum_gradients(d: Dist, params: list[torch.nn.Parameter]) -> None:
    """Sum .grad over ranks in one flat buffer. Parameters without a gradient (a layer every
    sample of the step dropped, an exit the curriculum left out) get zeros first, so every
    rank (and a single process) hands AdamW the same set of gradients."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if d.world == 1:
        return
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off : off + n].view_as(g))
        off += n
