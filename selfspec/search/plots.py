"""The search's history plot (matplotlib, imported when a plot is drawn: optional)."""

from __future__ import annotations

import io
import os

import numpy as np

from selfspec.extras import pyplot
from selfspec.profiles import atomic_write_bytes
from selfspec.search.study import trial_rows


def plot_history(study, path: str | os.PathLike, title: str = "", objective: str = "predicted",
                 confirmed: dict | None = None) -> None:
    """Optimisation history: every trial's objective (labelled as predicted or measured) and
    the best so far; with `confirmed` (the winner's metrics after measurement) the winner's
    measured speedup beside its trial's value, so a prediction that did not hold shows."""
    plt = pyplot()

    rows = sorted(trial_rows(study), key=lambda r: r["number"])
    if not rows:
        return
    xs = [r["number"] for r in rows]
    ys = [r["value"] for r in rows]
    what = "predicted" if objective == "predicted" else "measured"
    colors = {"early-exit": "tab:blue", "layer-skip": "tab:orange", "prompt-lookup": "tab:green", "exit-adapter": "tab:purple",
              "quantized": "tab:red"}
    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=110)
    for strat, col in colors.items():
        pts = [(x, y) for x, y, r in zip(xs, ys, rows) if r.get("draft", {}).get("strategy") == strat]
        if pts:
            ax.scatter(*zip(*pts), s=14, color=col, label=f"{strat} ({what})", alpha=0.8)
    ax.plot(xs, np.maximum.accumulate(ys), color="black", lw=1.5, label=f"best so far ({what})")
    ax.axhline(1.0, color="gray", ls="--", lw=0.8, label="autoregressive (1.0)")
    if confirmed and confirmed.get("measured_speedup") is not None and confirmed.get("number") is not None:
        x, m = confirmed["number"], confirmed["measured_speedup"]
        ax.scatter([x], [m], s=110, marker="*", color="red", zorder=5,
                   label=f"winner, measured against plain decoding: {m:.2f}x")
        if objective == "predicted" and confirmed.get("predicted_speedup") is not None:
            ax.annotate("", xy=(x, m), xytext=(x, confirmed["predicted_speedup"]),
                        arrowprops=dict(arrowstyle="->", color="red", lw=1))
    ax.set_xlabel("trial")
    ax.set_ylabel("predicted speedup over autoregressive\n(replayed greedy decoding x measured costs)" if what == "predicted"
                  else "measured speedup over autoregressive\n(timed generations)")
    ax.set_title((title or "draft search") + f" - objective: {what}", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
