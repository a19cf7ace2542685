"""Checkpoints and the output directory.

    OUT/
      checkpoints/step-000200/     resumable: the recipe's weights (HF safetensors directory,
                                   or adapter.safetensors) + trainer_state.pt
      final/                       what the run produced (see the recipe modules)
      metrics.jsonl                one line per logged step / evaluation
      loss_curve.png

Every directory is built under a temporary name beside its target and renamed into place,
so a killed run leaves either the previous checkpoint or the new one, never half of one
(a directory counts only once its trainer_state.pt exists, which is written last). A run
killed at any moment loses at most the steps since its last checkpoint.

trainer_state.pt holds the step, the AdamW state, the data position (implied by the step:
the data order is a pure function of seed and position, see data.sequence_order), the RNG
states, and the run's TrainConfig, which --resume checks against.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from selfspec.errors import SelfSpecError

CHECKPOINTS = "checkpoints"
FINAL = "final"
STATE_FILE = "trainer_state.pt"
FORMAT = "selfspec-trainer-state/1"


def check_output_dir(out: Path, resume: bool) -> None:
    """Before any work: OUT is writable, and a previous run in it is never overwritten
    unless resuming it."""
    if out.exists() and not out.is_dir():
        raise SelfSpecError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SelfSpecError(f"cannot write to --out {out}: {e.strerror or e}") from e
    has_run = (out / CHECKPOINTS).exists() or (out / FINAL).exists() or (out / "metrics.jsonl").exists()
    if resume and latest_checkpoint(out) is None:
        raise SelfSpecError(f"nothing to resume: {out} has no complete checkpoint")
    if not resume and has_run:
        raise SelfSpecError(f"{out} already holds a training run; pass --resume to continue it or choose another --out")


def checkpoint_dirs(out: Path) -> list[Path]:
    root = out / CHECKPOINTS
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(out: Path) -> Path | None:
    dirs = checkpoint_dirs(out)
    return dirs[-1] if dirs else None


def write_dir_atomically(target: Path, fill: Callable[[Path], None]) -> Path:
    """Build `target` in a temporary sibling with fill(tmp), then rename it into place
    (an existing target is moved aside first and removed after)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(tmp)
        _usual_permissions(tmp)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / target.name)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _usual_permissions(root: Path) -> None:
    """Temporary files and directories are private (0600 / 0700); the result should get the
    permissions a plainly created file would (0666 / 0777 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    root.chmod(0o777 & ~umask)
    for p in root.rglob("*"):
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_checkpoint(out: Path, step: int, save_weights: Callable[[Path], None], state: dict, keep: int) -> Path:
    def fill(tmp: Path) -> None:
        save_weights(tmp)
        torch.save({"format": FORMAT, **state}, tmp / STATE_FILE)  # last: marks the directory complete

    path = write_dir_atomically(out / CHECKPOINTS / f"step-{step:06d}", fill)
    for old in checkpoint_dirs(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def read_trainer_state(ckpt: Path) -> dict:
    try:
        state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as e:
        raise SelfSpecError(f"cannot read checkpoint {ckpt}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SelfSpecError(f"{ckpt} is not a selfspec training checkpoint")
    return state
