"""PNG plots of a training run (matplotlib, Agg backend, written atomically)."""

from __future__ import annotations

import io
from pathlib import Path

from selfspec.extras import pyplot
from selfspec.profiles import atomic_write_bytes


def _figure(ncols: int, width: float = 6.0):
    plt = pyplot()
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, 4.2), squeeze=False)
    return plt, fig, axes[0]


def _save(plt, fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def loss_curve(records: list[dict], path: Path, title: str = "") -> None:
    """Left: training loss per step (the optimised total and the final layer's LM loss) and
    held-out loss. Right: per-layer top-1 agreement with the final layer at the latest
    evaluation (when the run evaluates exits)."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval" in r]
    last = evals[-1]["eval"] if evals else None
    has_layers = bool(last and ("exit_agreement" in last or "adapter_agreement" in last))
    plt, fig, axes = _figure(2 if has_layers else 1)
    ax = axes[0]
    if train:
        steps = [r["step"] for r in train]
        ax.plot(steps, [r["loss"] for r in train], lw=0.8, alpha=0.8, label="train loss (optimised)")
        if any(r.get("final_loss") is not None for r in train) and any(r.get("final_loss") != r["loss"] for r in train):
            ax.plot(steps, [r.get("final_loss") for r in train], lw=0.8, alpha=0.8, label="train LM loss (last layer)")
    if evals:
        key = "eval_loss" if "eval_loss" in evals[0]["eval"] else "distill_loss"
        ax.plot([r["step"] for r in evals], [r["eval"].get(key) for r in evals], "o-", ms=3, label=f"held-out {key.replace('_', ' ')}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title or "training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if has_layers:
        ax = axes[1]
        if "exit_agreement" in last:
            agree = last["exit_agreement"]
            ax.plot(range(1, len(agree) + 1), agree, "o-", ms=3, label=f"step {evals[-1]['step']}")
            if len(evals) > 1:
                first = evals[0]["eval"]["exit_agreement"]
                ax.plot(range(1, len(first) + 1), first, "o--", ms=3, alpha=0.6, label=f"step {evals[0]['step']}")
            ax.set_xlabel("exit after layer")
            ax.set_ylabel("top-1 agreement with the last layer")
            if last.get("caveat"):  # a degenerate last layer (see layerskip.degenerate_caveat)
                ax.set_title(f"caveat: the last layer predicts one token at {last['final_top_token_share']:.0%} of positions",
                             fontsize=8, color="#a40")
        else:
            steps = [r["step"] for r in evals]
            ax.plot(steps, [r["eval"]["adapter_agreement"] for r in evals], "o-", ms=3, label="exit adapter")
            ax.plot(steps, [r["eval"]["early_exit_agreement"] for r in evals], "o--", ms=3, label="plain early exit (same vocab)")
            ax.set_xlabel("step")
            ax.set_ylabel("top-1 agreement with the full model")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(plt, fig, path)


def agreement_curves(curves: dict[str, list[float]], path: Path, title: str) -> None:
    """One line per run: top-1 agreement of the exit after layer l with the last layer."""
    plt, fig, axes = _figure(1, width=7.0)
    ax = axes[0]
    for label, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, "o-", ms=3, label=label)
    ax.set_xlabel("exit after layer")
    ax.set_ylabel("top-1 agreement with the last layer (held out)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(plt, fig, path)
