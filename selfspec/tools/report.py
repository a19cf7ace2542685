"""`selfspec report`: render saved results (bench, sweep, correctness, compare_all) as tables
and PNG plots, plus an HTML page with both, so runs from different machines can be put side
by side: `selfspec report laptop.json server.json --out-dir report/`.

Plots (matplotlib, Agg backend):
  bench_speedup.png             speedup per run (bar: ratio of means, dot: median per prompt)
  bench_tokens_per_second.png   autoregressive vs strategy tokens/s per run
  bench_acceptance.png          acceptance by draft position per run
  bench_time_split.png          share of time in prefill / draft / verify / other
  <name>_heatmap.png, <name>_acceptance.png   for each sweep file
  compare_speedup.png           speedup of every method per data set (compare_all files)
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.profiles import atomic_write_text

KINDS = ("bench", "sweep", "correctness", "compare")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_results(path: str | os.PathLike) -> dict:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError as e:
        raise SelfSpecError(f"results file not found: {path}") from e
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SelfSpecError(f"cannot read {path}: {e}") from e
    if not isinstance(d, dict) or d.get("kind") not in KINDS:
        raise SelfSpecError(f"{path} is not a selfspec results file (bench, sweep, correctness or compare_all output)")
    d["_path"] = str(p)
    return d


def machine_label(r: dict) -> str:
    env = r.get("environment") or {}
    dev = env.get("gpu") if str(r.get("model", {}).get("device", "cpu")).startswith("cuda") else env.get("cpu")
    dev = (dev or "?").replace("(R)", "").replace("(TM)", "").replace(" CPU", "")
    if len(dev) > 28:
        dev = dev[:27] + "…"
    return f"{env.get('hostname', '?')} · {dev} · {env.get('torch_threads', '?')}t"


def run_labels(results: list[dict], labels: list[str] | None = None) -> list[str]:
    if labels:
        if len(labels) != len(results):
            raise SelfSpecError(f"--labels: {len(labels)} labels for {len(results)} files")
        return list(labels)
    out = []
    for r in results:
        what = r.get("strategy_label") or r.get("strategy") or r["kind"]
        out.append(f"{what} | {r['model']['dtype']} | {machine_label(r)}")
    if len(set(out)) < len(out):  # disambiguate with the file name
        out = [f"{lab} | {Path(r['_path']).stem}" for lab, r in zip(out, results)]
    return out


def _fmt(x, f="{:.2f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f.format(x)


# ---- tables (rows shared by the console and the HTML page) ---------------------------------------


def bench_rows(results: list[dict], labels: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["run", "model", "dataset", "n", "AR tok/s", "spec tok/s", "speedup", "median", "acceptance",
            "tokens/verify", "TTFT AR/spec (s)", "draft/verify share", "peak MB", "ROUGE-L", "parses", "identical"]
    rows = []
    for lab, r in zip(labels, results):
        a = r.get("aggregate")
        if not a:
            rows.append([lab, r["model"]["fingerprint"], r["dataset"]["name"], "0"] + ["-"] * (len(head) - 4))
            continue
        b, s = a["baseline"], a["strategy"]
        sh = s["time_split_share"]
        rows.append([
            lab + (" [interrupted]" if r.get("interrupted") else ""),
            f"{r['model']['name']} {r['model']['fingerprint'][:8]}",
            f"{r['dataset']['name']} ({r['dataset']['hash'][:6]})",
            str(a["samples"]),
            _fmt(b["tokens_per_second"]),
            _fmt(s["tokens_per_second"]),
            _fmt(a["speedup"]) + "x",
            _fmt(a["speedup_median"]) + "x",
            _fmt(s["acceptance_rate"], "{:.1%}"),
            _fmt(s["mean_accepted_length"]),
            f"{_fmt(b['time_to_first_token_s'], '{:.3f}')}/{_fmt(s['time_to_first_token_s'], '{:.3f}')}",
            f"{sh['draft']:.0%}/{sh['verify']:.0%}",
            f"{_fmt(b.get('peak_memory_mb'), '{:.0f}')}/{_fmt(s.get('peak_memory_mb'), '{:.0f}')}",
            _fmt((s.get("rouge") or {}).get("rougeL"), "{:.3f}"),
            _fmt(s.get("code_parse_rate"), "{:.0%}"),
            f"{a['identical_outputs']}/{a['samples']}",
        ])
    return head, rows


def sweep_rows(r: dict) -> tuple[list[str], list[list[str]]]:
    rk = "exit layer" if r["row_kind"] == "exit_layer" else "skip ratio"
    head = [f"{rk} \\ K"] + [str(k) for k in r["num_speculations"]]
    best = r.get("best") or {}
    rows = []
    for row in r["rows"]:
        line = [str(row)]
        for K in r["num_speculations"]:
            c = _cell(r, row, K)
            s = (c or {}).get("summary")
            if not s or s.get("speedup") is None:
                line.append("-")
            else:
                mark = " *" if best.get("row") == row and best.get("draft", {}).get("num_speculations") == K else ""
                line.append(f"{s['speedup']:.2f}x / {s['acceptance_rate']:.0%}{mark}")
        rows.append(line)
    return head, rows


def correctness_rows(results: list[dict], labels: list[str]) -> tuple[list[str], list[list[str]]]:
    head = ["run", "dataset", "prompts", "mismatches", "first difference", "mismatching ids"]
    rows = []
    for lab, r in zip(labels, results):
        rows.append([lab, r["dataset"]["name"], str(r["completed"]), str(r["mismatches"]),
                     _fmt(r.get("first_difference"), "{}"), ", ".join(r.get("mismatch_ids") or []) or "-"])
    return head, rows


def compare_rows(r: dict) -> tuple[list[str], list[list[str]]]:
    head = ["dataset", "method", "n", "tok/s", "vs selfspec AR", "vs HF generate", "acceptance", "same tokens as AR"]
    rows = []
    for ds, methods in r["aggregate"].items():
        for name, a in methods.items():
            rows.append([ds, name, str(a["runs"]), _fmt(a["tokens_per_second"]), _fmt(a.get("speedup_vs_autoregressive")) + "x",
                         _fmt(a.get("speedup_vs_hf_generate")) + "x", _fmt(a.get("acceptance_rate"), "{:.1%}"),
                         f"{a.get('identical_to_autoregressive', '-')}/{a['runs']}"])
    return head, rows


def rich_table(title: str, head: list[str], rows: list[list[str]], caption: str | None = None):
    from rich.table import Table

    t = Table(title=title, caption=caption)
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        t.add_row(*row)
    return t


def html_table(head: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


# ---- plots ---------------------------------------------------------------------------------------


def _save(fig, path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")  # long run labels stay inside the image


def _cell(r: dict, row, K):
    for c in r["cells"]:
        if c["row"] == row and c["draft"]["num_speculations"] == K:
            return c
    return None


def _title(r: dict) -> str:
    m = r["model"]
    return f"{m['name']} ({m['dtype']}, {m['device']}) - {r['dataset']['name']} x{r['requested']} - {machine_label(r)}"


def sweep_plots(r: dict, out_dir: str | os.PathLike, prefix: str = "sweep") -> list[Path]:
    """Heatmap of speedup over (row, K) with the best cell marked, and acceptance by row."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, ks = r["rows"], r["num_speculations"]
    rk = "exit layer" if r["row_kind"] == "exit_layer" else f"skip ratio ({r.get('skip_kind') or 'both'})"
    speed = np.full((len(rows), len(ks)), np.nan)
    acc = np.full((len(rows), len(ks)), np.nan)
    for i, row in enumerate(rows):
        for j, K in enumerate(ks):
            s = (_cell(r, row, K) or {}).get("summary")
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


# ---- the report ----------------------------------------------------------------------------------


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child,th:first-child{text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee;margin:.5em 0}.warn{color:#a40}code{font-size:12px}"""


def report(paths: list[str], out_dir: str | os.PathLike = "report", labels: list[str] | None = None, html_page: bool = True, console=None) -> dict:
    """Print tables, write plots (and index.html) to out_dir. -> {"plots": [...], "html": path|None, "warnings": [...]}"""
    from selfspec.tools.bench import strategy_label

    if not paths:
        raise SelfSpecError("report needs at least one results file")
    results = [load_results(p) for p in paths]
    if console is None:
        from rich.console import Console

        console = Console()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    all_labels = run_labels(results, labels)
    plots: list[Path] = []
    warnings: list[str] = []
    sections: list[str] = []

    by_kind: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        by_kind.setdefault(r["kind"], []).append(i)

    def files_html(idx):
        return "<ul>" + "".join(
            f"<li><code>{html.escape(results[i]['_path'])}</code>: {html.escape(all_labels[i])}; created {html.escape(str(results[i].get('created')))}; "
            f"model {html.escape(results[i]['model']['fingerprint'])}; torch {html.escape(str((results[i].get('environment') or {}).get('versions', {}).get('torch')))}</li>"
            for i in idx) + "</ul>"

    if "bench" in by_kind:
        idx = by_kind["bench"]
        rs, labs = [results[i] for i in idx], [all_labels[i] for i in idx]
        fps = {r["model"]["fingerprint"] for r in rs}
        hashes = {(r["dataset"]["name"], r["dataset"]["hash"]) for r in rs}
        if len(fps) > 1:
            warnings.append(f"bench runs used different models (fingerprints {', '.join(sorted(fps))})")
        if len({h for _, h in hashes}) > 1:
            warnings.append("bench runs used different prompts (dataset hashes differ: " + ", ".join(f"{n}:{h}" for n, h in sorted(hashes)) + ")")
        head, rows = bench_rows(rs, labs)
        console.print(rich_table("bench runs", head, rows, "speedup = ratio of mean throughput; median = of per-prompt ratios"))
        ps = bench_plots(rs, labs, out)
        plots += ps
        sections.append("<h2>bench</h2>" + files_html(idx) + html_table(head, rows) + "".join(f'<img src="{p.name}">' for p in ps))

    for i in by_kind.get("sweep", []):
        r = results[i]
        head, rows = sweep_rows(r)
        best = r.get("best")
        cap = "speedup / acceptance; * best" + (f": {strategy_label(best['draft'])} x{best['speedup']:.2f}" if best else "")
        console.print(rich_table(f"sweep {all_labels[i]}", head, rows, cap))
        stem = Path(r["_path"]).stem
        ps = sweep_plots(r, out, prefix=f"{stem}_{i}" if len(by_kind["sweep"]) > 1 else stem)
        plots += ps
        sections.append(f"<h2>sweep: {html.escape(all_labels[i])}</h2>" + files_html([i]) + html_table(head, rows)
                        + f"<p>{html.escape(cap)}</p>" + "".join(f'<img src="{p.name}">' for p in ps))

    if "correctness" in by_kind:
        idx = by_kind["correctness"]
        head, rows = correctness_rows([results[i] for i in idx], [all_labels[i] for i in idx])
        console.print(rich_table("correctness (greedy, token for token)", head, rows))
        sections.append("<h2>correctness</h2>" + files_html(idx) + html_table(head, rows))

    for i in by_kind.get("compare", []):
        r = results[i]
        head, rows = compare_rows(r)
        console.print(rich_table(f"compare_all {all_labels[i]}", head, rows))
        stem = Path(r["_path"]).stem
        ps = compare_plots(r, out, prefix=f"{stem}_{i}" if len(by_kind["compare"]) > 1 else stem)
        plots += ps
        sections.append(f"<h2>compare_all: {html.escape(all_labels[i])}</h2>" + files_html([i]) + html_table(head, rows)
                        + "".join(f'<img src="{p.name}">' for p in ps))

    for w in warnings:
        console.print(f"[yellow]warning:[/] {w}")
    page = None
    if html_page:
        page = out / "index.html"
        warn = "".join(f'<p class="warn">warning: {html.escape(w)}</p>' for w in warnings)
        atomic_write_text(page, f"<!doctype html><html><head><meta charset='utf-8'><title>selfspec report</title><style>{_CSS}</style></head>"
                                f"<body><h1>selfspec report</h1>{warn}{''.join(sections)}</body></html>\n")
    for p in plots:
        console.print(f"wrote {p}")
    if page:
        console.print(f"wrote {page}")
    return {"plots": [str(p) for p in plots], "html": str(page) if page else None, "warnings": warnings}
