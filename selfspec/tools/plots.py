"""Plots of saved results (matplotlib, Agg backend), written as PNG files; CHARTS says what each
shows (the HTML report prints it under the image)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from selfspec.extras import pyplot
from selfspec.profiles import atomic_write_bytes
from selfspec.tools.tables import cell, machine_label


def _plt():
    return pyplot()



CHARTS = {
    "bench_speedup": "Speedup of each run over autoregressive decoding: the bar is the ratio of mean throughputs, the dot "
                     "the median of the per-prompt speedups. The dashed line at 1.0 is plain decoding: bars left of it "
                     "are slower.",
    "bench_tokens_per_second": "Throughput of each run: autoregressive decoding (grey) and the strategy (orange), "
                               "generated tokens per second, prefill included.",
    "bench_acceptance": "Acceptance by draft position: of the drafts at position i of a step (1 = the first drafted "
                        "token), the share the full model accepted. A position is only reached when every earlier one "
                        "was accepted.",
    "bench_time_split": "Where the generation time goes, for autoregressive decoding [AR] and the strategy [spec]: "
                        "prefill (the prompt), drafting, verification, and everything else.",
    "heatmap": "Speedup over autoregressive decoding of every (row, K) setting: green is faster, red slower, white "
               "equal; the boxed cell with a star is the best setting.",
    "acceptance": "Acceptance rate (accepted / drafted tokens) of every row, one line per K.",
    "compare_speedup": "Speedup of every method over selfspec's autoregressive decoding, per prompt set; the dashed "
                       "line at 1.0 is plain decoding.",
}


def chart_text(path: Path) -> str:
    for key, text in CHARTS.items():
        if path.stem == key or path.stem.endswith("_" + key):
            return text
    return ""



def _save(fig, path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")  # long run labels stay inside the image
    atomic_write_bytes(path, buf.getvalue())



def _title(r: dict) -> str:
    m = r["model"]
    return f"{m['name']} ({m['dtype']}, {m['device']}) - {r['dataset']['name']} x{r['requested']} - {machine_label(r)}"


def sweep_plots(r: dict, out_dir: str | os.PathLike, prefix: str = "sweep") -> list[Path]:
    """Heatmap of speedup over (row, K) with the best cell marked, and acceptance by row."""
    plt = _plt()
    from matplotlib.colors import TwoSlopeNorm  # plotting only, after _plt chose the backend
    from matplotlib.patches import Rectangle  # plotting only, as above

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, ks = r["rows"], r["num_speculations"]
    rk = {"exit_layer": "exit layer", "draft_bits": "draft bits"}.get(r["row_kind"], f"skip ratio ({r.get('skip_kind') or 'both'})")
    speed = np.full((len(rows), len(ks)), np.nan)
    acc = np.full((len(rows), len(ks)), np.nan)
    for i, row in enumerate(rows):
        for j, K in enumerate(ks):
            s = (cell(r, row, K) or {}).get("summary")
            if s and s.get("speedup") is not None:
                speed[i, j] = s["speedup"]
                acc[i, j] = s["acceptance_rate"]
    paths = []

    fig, ax = plt.subplots(figsize=(1.2 + 0.75 * len(ks) + 1.5, 1.0 + 0.5 * len(rows) + 1.2))
    finite = speed[np.isfinite(speed)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.5, 1.5)
    norm = TwoSlopeNorm(vmin=min(lo, 0.999), vcenter=1.0, vmax=max(hi, 1.001))
    im = ax.imshow(np.ma.masked_invalid(speed), cmap="RdYlGn", norm=norm, aspect="auto", origin="lower")
    ax.set_xticks(range(len(ks)), [str(k) for k in ks])
    ax.set_yticks(range(len(rows)), [str(x) for x in rows])
    ax.set_xlabel("K (num_speculations)")
    ax.set_ylabel(rk)
    for i in range(len(rows)):
        for j in range(len(ks)):
            if np.isfinite(speed[i, j]):
                ax.text(j, i, f"{speed[i, j]:.2f}", ha="center", va="center", fontsize=8)
    best = r.get("best")
    if best:
        i, j = rows.index(best["row"]), ks.index(best["draft"]["num_speculations"])
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.5))
        ax.plot([j], [i + 0.3], marker="*", color="black", markersize=9)
    fig.colorbar(im, ax=ax, label="speedup vs autoregressive")
    ax.set_title(f"{r['strategy']} speedup" + (f" (best x{best['speedup']:.2f})" if best else "") + "\n" + _title(r), fontsize=8)
    fig.tight_layout()
    p = out_dir / f"{prefix}_heatmap.png"
    _save(fig, p)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = list(range(len(rows)))
    for j, K in enumerate(ks):
        ax.plot(xs, acc[:, j], marker="o", label=f"K={K}")
    ax.set_xticks(xs, [str(x) for x in rows])
    ax.set_xlabel(rk)
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"{r['strategy']} acceptance rate\n" + _title(r), fontsize=8)
    fig.tight_layout()
    p = out_dir / f"{prefix}_acceptance.png"
    _save(fig, p)
    plt.close(fig)
    paths.append(p)
    return paths


def bench_plots(results: list[dict], labels: list[str], out_dir: Path) -> list[Path]:
    plt = _plt()
    done = [(lab, r) for lab, r in zip(labels, results) if r.get("aggregate")]
    if not done:
        return []
    paths = []
    n = len(done)
    h = 1.2 + 0.45 * n

    fig, ax = plt.subplots(figsize=(9, h))
    ys = list(range(n))
    ax.barh(ys, [r["aggregate"]["speedup"] or 0 for _, r in done], color="#4c78a8", label="ratio of means")
    ax.scatter([r["aggregate"]["speedup_median"] or 0 for _, r in done], ys, color="black", zorder=3, label="median per prompt")
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_yticks(ys, [lab for lab, _ in done], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speedup vs autoregressive")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("selfspec bench: speedup", fontsize=9)
    fig.tight_layout()
    paths.append(out_dir / "bench_speedup.png")
    _save(fig, paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, h))
    w = 0.4
    ax.barh([y - w / 2 for y in ys], [r["aggregate"]["baseline"]["tokens_per_second"] for _, r in done], w, label="autoregressive", color="#bab0ac")
    ax.barh([y + w / 2 for y in ys], [r["aggregate"]["strategy"]["tokens_per_second"] for _, r in done], w, label="strategy", color="#f58518")
    ax.set_yticks(ys, [lab for lab, _ in done], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("selfspec bench: throughput", fontsize=9)
    fig.tight_layout()
    paths.append(out_dir / "bench_tokens_per_second.png")
    _save(fig, paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for lab, r in done:
        pp = r["aggregate"]["strategy"].get("per_position_acceptance") or []
        if pp:
            ax.plot(range(1, len(pp) + 1), [float("nan") if x is None else x for x in pp], marker="o", label=lab)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("selfspec bench: acceptance by draft position", fontsize=9)
    fig.tight_layout()
    paths.append(out_dir / "bench_acceptance.png")
    _save(fig, paths[-1])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * n))
    colors = {"prefill": "#72b7b2", "draft": "#f58518", "verify": "#4c78a8", "other": "#bab0ac"}
    names, shares = [], []
    for lab, r in done:
        for which in ("baseline", "strategy"):
            names.append(f"{lab} [{'AR' if which == 'baseline' else 'spec'}]")
            shares.append(r["aggregate"][which]["time_split_share"])
    left = [0.0] * len(names)
    for k, col in colors.items():
        vals = [s[k] for s in shares]
        ax.barh(range(len(names)), vals, left=left, color=col, label=k)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of generation time")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("selfspec bench: where the time goes", fontsize=9)
    fig.tight_layout()
    paths.append(out_dir / "bench_time_split.png")
    _save(fig, paths[-1])
    plt.close(fig)
    return paths


def compare_plots(r: dict, out_dir: Path, prefix: str = "compare") -> list[Path]:
    plt = _plt()
    agg = r["aggregate"]
    datasets = list(agg)
    methods = []
    for ds in datasets:
        for m in agg[ds]:
            if m not in methods:
                methods.append(m)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(datasets) * max(1, len(methods)) / 3), 4.5))
    w = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [(agg[ds].get(m) or {}).get("speedup_vs_autoregressive") or 0 for ds in datasets]
        ax.bar([i + (j - (len(methods) - 1) / 2) * w for i in range(len(datasets))], vals, w, label=m)
    ax.axhline(1.0, color="grey", linestyle="--")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("speedup vs selfspec autoregressive")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("compare_all: " + _title({**r, "requested": r.get("num_samples", "?")}), fontsize=8)
    fig.tight_layout()
    p = out_dir / f"{prefix}_speedup.png"
    _save(fig, p)
    plt.close(fig)
    return [p]
