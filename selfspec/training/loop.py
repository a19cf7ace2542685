"""The training loop every recipe shares: AdamW, warm-up + cosine, gradient accumulation,
data parallelism, gradient clipping, bf16 autocast, periodic evaluation and checkpoints,
step and time budgets, a progress bar, a metrics log and a loss-curve PNG.

A recipe is a task object (layerskip.LayerSkipTask, adapter_train.AdapterTask) with
    params, param_groups(wd), num_sequences(), tokens_per_sequence(), train(on)
    begin_step(step, global_indices)                 normalisers for the whole step
    micro_loss(step, micro, rows, start, global_rows) -> (loss, metrics)   this rank's rows
    evaluate(batch_size) -> dict, summary(eval) -> str
    save_weights(dir)                                what a checkpoint needs to resume

One optimizer step t (0-based) covers the global sequences number t*B*A .. (t+1)*B*A - 1 of
the seeded data order (data.sequence_order): A micro-batches of B sequences, each split into
equal row blocks over the ranks. Losses are pre-normalised by global target counts, so
gradients are *summed* over micro-batches and ranks.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from selfspec.errors import SelfSpecError
from selfspec.profiles import atomic_write_text
from selfspec.training import checkpoint as ckpt, plots
from selfspec.training.config import TrainConfig
from selfspec.training.data import sequence_order
from selfspec.training.distributed import Dist, all_reduce_sum, any_rank, barrier, sum_gradients
from selfspec.training.schedules import lr_at, replan_on_resume

METRICS = "metrics.jsonl"
LOSS_CURVE = "loss_curve.png"


@dataclass
class LoopResult:
    step: int
    tokens: int
    train_seconds: float
    stopped_by: str  # "max_steps" | "max_minutes" | "interrupt"
    last_eval: dict | None = None
    records: list[dict] = field(default_factory=list)


class MetricsLog:
    """OUT/metrics.jsonl: one JSON object per step ({"step", "loss", ...}) or evaluation
    ({"step", "eval": {...}}). Resuming drops what a killed run logged after its checkpoint."""

    def __init__(self, path: Path, keep_through_step: int, enabled: bool):
        self.path, self.enabled = path, enabled
        self.records: list[dict] = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if r.get("step", 0) <= keep_through_step:
                    self.records.append(r)
        if enabled:
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in self.records))

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


class _Interrupt:
    """Ctrl-C sets a flag; the loop stops between steps, after writing a checkpoint."""

    def __init__(self):
        self.flag = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_):
        if self.flag:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.flag = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


class _Progress:
    def __init__(self, enabled: bool, total: int, done: int, description: str):
        self.p = None
        if enabled:
            self.p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=_console())
            self.task = self.p.add_task(description, total=total, completed=done, status="")
            self.p.start()

    def update(self, step: int, status: str) -> None:
        if self.p is not None:
            self.p.update(self.task, completed=step, status=status)

    def log(self, msg: str, fallback: Callable[[str], None]) -> None:
        if self.p is not None:
            self.p.console.print(msg, highlight=False, soft_wrap=True)
        else:
            fallback(msg)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()


def _console():
    c = Console(stderr=True)
    return c if c.is_terminal else Console(stderr=True, width=160)  # a log file: room for the status


def _autocast(loop, device: str):
    if not loop.bf16:
        return nullcontext()
    return torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16)


def _resume(task, loop, optimizer, resume_state: dict | None):
    """(step, tokens, train_s, curriculum horizon, lr replan, change note) to start from, the
    optimizer and RNG restored from resume_state. The curricula (layer dropout, exits) keep
    the run's first --max-steps; the learning rate may be re-planned when a resume changes it."""
    if resume_state is None:
        return 0, 0, 0.0, loop.max_steps, None, None
    optimizer.load_state_dict(resume_state["optimizer"])
    step, tokens, train_s = resume_state["step"], resume_state["tokens"], resume_state["train_seconds"]
    ckpt.set_rng_state(resume_state["rng"])
    saved = resume_state.get("schedule") or {}
    old_total = resume_state["config"]["loop"]["max_steps"]
    horizon = saved.get("curriculum_steps", old_total)
    replan = tuple(saved["lr_replan"]) if saved.get("lr_replan") else None
    replan, change = replan_on_resume(step, loop.lr, loop.warmup_steps, loop.min_lr_ratio, old_total, loop.max_steps, replan)
    if change and hasattr(task, "curriculum_steps"):
        change += f"; the layer-dropout and exit curricula keep their horizon (step {horizon})"
    return step, tokens, train_s, horizon, replan, change


def _optimizer_step(task, optimizer, d, loop, step: int, lr: float, n_seq: int) -> tuple[dict[str, float], float]:
    """One optimisation step at learning rate lr: grad_accum micro-batches of this process's
    shard, gradients summed over processes, clipped, applied. -> (metric sums over all
    processes, gradient norm)."""
    B, A = loop.batch_size, loop.grad_accum
    for group in optimizer.param_groups:
        group["lr"] = lr
    indices = sequence_order(n_seq, loop.seed, step * B * A, B * A)
    task.begin_step(step, indices)
    start, end = d.shard(B)
    sums: dict[str, torch.Tensor] = {}
    for micro in range(A):
        rows = indices[micro * B : (micro + 1) * B][start:end]
        with _autocast(loop, d.device):
            loss, m = task.micro_loss(step, micro, rows, start, B)
        loss.backward()
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v.float()
    sum_gradients(d, task.params)
    keys = sorted(sums)
    reduced = all_reduce_sum(d, torch.stack([sums[k] for k in keys]).to(d.device)).tolist() if keys else []
    norm = torch.nn.utils.clip_grad_norm_(task.params, loop.grad_clip if loop.grad_clip > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return dict(zip(keys, reduced)), float(norm)


def run_loop(
    cfg: TrainConfig,
    task,
    d: Dist,
    out: Path,
    resume_state: dict | None = None,
    log: Callable[[str], None] = print,
    on_step: Callable[[int, dict], None] | None = None,
    title: str = "",
) -> LoopResult:
    loop = cfg.loop
    B, A = loop.batch_size, loop.grad_accum
    if B % d.world:
        raise SelfSpecError(f"--batch-size {B} must be a multiple of the number of processes ({d.world})")
    optimizer = torch.optim.AdamW(task.param_groups(loop.weight_decay), lr=loop.lr, betas=(0.9, loop.adam_beta2), eps=1e-8)
    step, tokens, train_s, horizon, replan, change = _resume(task, loop, optimizer, resume_state)
    if hasattr(task, "curriculum_steps"):
        task.curriculum_steps = horizon
    metrics = MetricsLog(out / METRICS, step, d.is_main)
    n_seq, T = task.num_sequences(), task.tokens_per_sequence()

    def evaluate() -> dict:
        ev = task.evaluate(max(1, B // d.world))
        metrics.write({"step": step, "eval": ev})
        if d.is_main:
            plots.loss_curve(metrics.records, out / LOSS_CURVE, title)
        return ev

    def save() -> None:
        if d.is_main:
            state = {"step": step, "tokens": tokens, "train_seconds": train_s, "optimizer": optimizer.state_dict(),
                     "rng": ckpt.rng_state(), "config": cfg.to_dict(), "world": d.world,
                     "schedule": {"curriculum_steps": horizon, "lr_replan": list(replan) if replan else None}}
            ckpt.write_checkpoint(out, step, task.save_weights, state, loop.keep_checkpoints)
        barrier(d)

    deadline = None if loop.max_minutes is None else time.monotonic() + loop.max_minutes * 60
    last_eval = None
    if resume_state is None:
        last_eval = evaluate()  # the starting point of every curve
    bar = _Progress(d.is_main and not loop.no_progress, loop.max_steps, step, title or cfg.recipe)
    if last_eval is not None:
        bar.log(f"step {step}: {task.summary(last_eval)}", log)
    if change:
        bar.log(f"resume: {change}", log)
    stopped_by = "max_steps"
    task.train(True)
    try:
        with _Interrupt() as interrupt:
            while step < loop.max_steps:
                t0 = time.perf_counter()
                lr = lr_at(step, loop.lr, loop.warmup_steps, loop.max_steps, loop.min_lr_ratio, replan)
                sums, norm = _optimizer_step(task, optimizer, d, loop, step, lr, n_seq)
                step += 1
                tokens += B * A * T
                dt = time.perf_counter() - t0
                train_s += dt
                rec = {"step": step, "lr": lr, **sums, "grad_norm": norm, "tokens": tokens, "tokens_per_second": B * A * T / dt}
                metrics.write(rec)
                if on_step is not None:
                    on_step(step, rec)
                bar.update(step, f"loss {rec.get('loss', float('nan')):.3f} | {tokens / max(train_s, 1e-9):,.0f} tok/s | lr {lr:.2e}")
                interrupted = any_rank(d, interrupt.flag)
                over = any_rank(d, deadline is not None and time.monotonic() > deadline)
                stop = interrupted or over
                if stop:
                    stopped_by = "interrupt" if interrupted else "max_minutes"
                if step % loop.eval_every == 0 or step == loop.max_steps or stop:
                    last_eval = evaluate()
                    bar.log(f"step {step}: {task.summary(last_eval)}", log)
                if step % loop.checkpoint_every == 0 or step == loop.max_steps or stop:
                    save()
                if stop:
                    break
    finally:
        bar.close()
        task.train(False)
    if last_eval is None:  # resumed a run that had already finished: nothing ran
        last_eval = evaluate()
    return LoopResult(step, tokens, train_s, stopped_by, last_eval, metrics.records)
