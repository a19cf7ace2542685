"""`selfspec report`: render saved results (bench, sweep, correctness, compare_all) as tables
and PNG plots, plus an HTML page with both, so runs from different machines can be put side
by side: `selfspec report laptop.json server.json --out-dir report/`.

In a terminal the tables fit its width: runs are numbered (their labels listed above the
table), the most useful columns that fit are shown and the rest named in the caption; a
grid too wide for the screen (a sweep over many K) is split into several tables. No cell is
ever narrower than its longest word. index.html has every column, with what each means.

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
from selfspec.profiles import atomic_write_bytes, atomic_write_text

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
                mark = "*" if best.get("row") == row and best.get("draft", {}).get("num_speculations") == K else ""
                line.append(f"{s['speedup']:.2f}x {s['acceptance_rate']:.0%}{mark}")
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
    """All columns at their natural widths (files, wide consoles); see console_tables."""
    from rich.table import Table

    t = Table(title=title, caption=caption)
    for i, h in enumerate(head):
        t.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        t.add_row(*row)
    return t


def _longest_word(text: str) -> int:
    return max((len(w) for w in text.split()), default=0)


def _table_width(widths: list[int]) -> int:
    return sum(widths) + 3 * len(widths) + 1  # rich's default box: a border and a space each side per column


def console_tables(title: str, head: list[str], rows: list[list[str]], width: int, *, priority: list[str] | None = None,
                   wrap: tuple[str, ...] = (), caption: str | None = None, omitted_note: str = "in index.html") -> list:
    """Tables that fit `width` columns without breaking a word.

    Every column needs its longest word (header words wrap; cells of the `wrap` columns wrap
    at spaces, other cells never). If all columns fit, one table; else with `priority` (the
    column names, most useful first) one table with the leading columns that fit, in their
    usual order, the others named in the caption; else the columns are split into several
    tables, each repeating the first column."""
    from rich.table import Table

    n = len(head)
    cells = [[str(r[i]) for r in rows] for i in range(n)]
    need = [max(_longest_word(head[i]), max((_longest_word(c) if head[i] in wrap else len(c) for c in cells[i]), default=0), 1)
            for i in range(n)]
    natural = [max(len(head[i]), max((len(c) for c in cells[i]), default=0), 1) for i in range(n)]

    def build(cols: list[int], title_: str, caption_: str | None):
        widths = [need[i] for i in cols]
        spare = width - _table_width(widths)
        for j, i in enumerate(cols):  # room left goes to the columns that would otherwise wrap
            more = min(max(spare, 0), natural[i] - widths[j])
            widths[j] += more
            spare -= more
        t = Table(title=title_, caption=caption_)
        for j, i in enumerate(cols):
            t.add_column(head[i], justify="left" if i == 0 or head[i] in wrap else "right", width=widths[j],
                         no_wrap=head[i] not in wrap and widths[j] >= natural[i], overflow="fold")
        for r in rows:
            t.add_row(*[str(r[i]) for i in cols])
        return t

    if _table_width(natural) <= width or _table_width(need) <= width:
        return [build(list(range(n)), title, caption)]
    if priority:
        order = [head.index(h) for h in priority if h in head] + [i for i in range(n) if head[i] not in priority]
        chosen: list[int] = []
        for i in order:
            if _table_width([need[j] for j in chosen + [i]]) <= width:
                chosen.append(i)
        left = [head[i] for i in range(n) if i not in chosen]
        note = f"not shown at {width} columns: {', '.join(left)} ({omitted_note})"
        return [build(sorted(chosen), title, f"{caption}; {note}" if caption else note)]
    groups: list[list[int]] = []
    for i in range(1, n):
        if groups and _table_width([need[0]] + [need[j] for j in groups[-1]] + [need[i]]) <= width:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [build([0] + g, f"{title} ({k + 1}/{len(groups)})", caption if k == len(groups) - 1 else None)
            for k, g in enumerate(groups)]


def numbered(labels: list[str]) -> tuple[list[str], list[str]]:
    """Short run ids for a terminal table ("#1"...) and the lines that say which is which."""
    ids = [f"#{i + 1}" for i in range(len(labels))]
    return ids, [f"{i} {lab}" for i, lab in zip(ids, labels)]


def html_table(head: list[str], rows: list[list[str]], help_: dict[str, str] | None = None) -> str:
    """A table, scrolling sideways rather than squeezing its cells, and under it what each
    column means (`help_`: column -> explanation)."""
    def th(h: str) -> str:
        tip = (help_ or {}).get(h)
        return f'<th title="{html.escape(tip)}">{html.escape(h)}</th>' if tip else f"<th>{html.escape(h)}</th>"

    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    out = f'<div class="scroll"><table><thead><tr>{"".join(th(h) for h in head)}</tr></thead><tbody>{trs}</tbody></table></div>'
    if help_:
        out += '<dl class="cols">' + "".join(f"<dt>{html.escape(h)}</dt><dd>{html.escape(help_[h])}</dd>" for h in head if h in help_) + "</dl>"
    return out


def html_figure(path: Path, text: str) -> str:
    return f'<figure><img src="{html.escape(path.name)}" alt="{html.escape(path.stem)}"><figcaption>{html.escape(text)}</figcaption></figure>'


# What each column and chart shows (the HTML page prints these under the tables and plots).
BENCH_COLUMNS = {
    "run": "the results file: strategy | dtype | machine (host · CPU or GPU · torch threads)",
    "model": "model name and the first digits of its fingerprint: runs with the same fingerprint used the same weights",
    "dataset": "prompt set and a hash of its prompts: runs with the same hash measured the same prompts",
    "n": "prompts measured",
    "AR tok/s": "autoregressive (plain) decoding in the same engine: generated tokens per second, prefill included",
    "spec tok/s": "the strategy's generated tokens per second, prefill included",
    "speedup": "spec tok/s divided by AR tok/s (ratio of total throughputs); below 1.00x the strategy is slower than plain decoding",
    "median": "median over prompts of each prompt's own speedup (robust to one long prompt)",
    "acceptance": "drafted tokens the full model accepted, as a share of all drafted tokens",
    "tokens/verify": "mean tokens committed per verification pass: the accepted drafts plus the full model's own token",
    "TTFT AR/spec (s)": "time to the first generated token (the prefill), autoregressive / strategy",
    "draft/verify share": "share of the strategy's generation time spent drafting / verifying",
    "peak MB": "peak memory while generating, autoregressive / strategy (see memory_method in the file)",
    "ROUGE-L": "ROUGE-L F1 of the strategy's outputs against the dataset's references (- without references)",
    "parses": "share of code completions that parse as Python (code prompts only)",
    "identical": "prompts whose output equals plain decoding token for token (greedy: all of them, or it is a bug)",
}
SWEEP_COLUMNS = {
    "cells": "speedup over autoregressive decoding (ratio of throughputs on the same prompts) and acceptance rate of "
             "each (row, K) setting; * marks the best setting; K = the most tokens drafted per verification",
}
CORRECTNESS_COLUMNS = {
    "run": "the results file",
    "dataset": "prompt set",
    "prompts": "prompts compared",
    "mismatches": "prompts whose greedy output differs from plain decoding (anything but 0 is a bug)",
    "first difference": "the earliest token position at which an output differs",
    "mismatching ids": "ids of the prompts that differ",
}
COMPARE_COLUMNS = {
    "dataset": "prompt set",
    "method": "decoding method (selfspec strategies, and transformers' own generate for reference)",
    "n": "generations measured",
    "tok/s": "generated tokens per second",
    "vs selfspec AR": "speed relative to selfspec's autoregressive decoding (below 1.00x: slower)",
    "vs HF generate": "speed relative to transformers' generate",
    "acceptance": "drafted tokens accepted, as a share of drafted tokens",
    "same tokens as AR": "generations whose tokens equal selfspec's autoregressive output",
}
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


def _chart_text(path: Path) -> str:
    for key, text in CHARTS.items():
        if path.stem == key or path.stem.endswith("_" + key):
            return text
    return ""


# ---- plots ---------------------------------------------------------------------------------------


def _save(fig, path) -> None:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")  # long run labels stay inside the image
    atomic_write_bytes(path, buf.getvalue())


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
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right;white-space:nowrap}td:first-child,th:first-child{text-align:left}
th{background:#f3f3f3}.scroll{overflow-x:auto}img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}
figcaption{font-size:13px;color:#444;max-width:900px}dl.cols{font-size:13px;display:grid;grid-template-columns:max-content auto;gap:2px 12px}
dl.cols dt{font-weight:600}dl.cols dd{margin:0}.warn{color:#a40;font-weight:600}code{font-size:12px}"""

BENCH_PRIORITY = ["run", "speedup", "spec tok/s", "AR tok/s", "acceptance", "identical", "tokens/verify", "median", "n",
                  "TTFT AR/spec (s)", "draft/verify share", "dataset", "peak MB", "ROUGE-L", "parses", "model"]
COMPARE_PRIORITY = ["method", "dataset", "vs selfspec AR", "tok/s", "acceptance", "same tokens as AR", "vs HF generate", "n"]
CORRECTNESS_PRIORITY = ["run", "mismatches", "prompts", "first difference", "dataset", "mismatching ids"]


def report(paths: list[str], out_dir: str | os.PathLike = "report", labels: list[str] | None = None, html_page: bool = True, console=None) -> dict:
    """Print tables (fitted to the console's width), write plots (and index.html, with every
    column) to out_dir. -> {"plots": [...], "html": path|None, "warnings": [...]}"""
    from rich.text import Text

    from selfspec.tools.bench import strategy_label

    if not paths:
        raise SelfSpecError("report needs at least one results file")
    results = [load_results(p) for p in paths]
    if console is None:
        from rich.console import Console

        console = Console()
    width = console.width
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

    def figures(ps: list[Path]) -> str:
        return "".join(html_figure(p, _chart_text(p)) for p in ps)

    def show(tables: list, legend: list[str] | None = None) -> None:
        for line in legend or ():
            console.print(Text(line), soft_wrap=False, overflow="fold")
        for t in tables:
            console.print(t)

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
        cap = "speedup = ratio of mean throughput; median = of per-prompt ratios"
        ids, legend = numbered([r[0] for r in rows])
        show(console_tables("bench runs", head, [[k] + r[1:] for k, r in zip(ids, rows)], width, priority=BENCH_PRIORITY,
                            wrap=("model", "dataset"), caption=cap), ["runs:"] + legend)
        ps = bench_plots(rs, labs, out)
        plots += ps
        sections.append("<h2>bench</h2>" + files_html(idx) + html_table(head, rows, BENCH_COLUMNS) + figures(ps))

    for i in by_kind.get("sweep", []):
        r = results[i]
        head, rows = sweep_rows(r)
        best = r.get("best")
        cap = "speedup / acceptance; * best" + (f": {strategy_label(best['draft'])} x{best['speedup']:.2f}" if best else "")
        loss = sweep_loss_warning(r)
        if loss:
            warnings.append(f"{all_labels[i]}: {loss}")
        show(console_tables(f"sweep {all_labels[i]}", head, rows, width, caption=cap))
        stem = Path(r["_path"]).stem
        ps = sweep_plots(r, out, prefix=f"{stem}_{i}" if len(by_kind["sweep"]) > 1 else stem)
        plots += ps
        sections.append(f"<h2>sweep: {html.escape(all_labels[i])}</h2>" + files_html([i]) + html_table(head, rows)
                        + f"<p>{html.escape(cap)}. {html.escape(SWEEP_COLUMNS['cells'])}.</p>" + figures(ps))

    if "correctness" in by_kind:
        idx = by_kind["correctness"]
        head, rows = correctness_rows([results[i] for i in idx], [all_labels[i] for i in idx])
        ids, legend = numbered([r[0] for r in rows])
        show(console_tables("correctness (greedy, token for token)", head, [[k] + r[1:] for k, r in zip(ids, rows)], width,
                            priority=CORRECTNESS_PRIORITY, wrap=("dataset", "mismatching ids")), ["runs:"] + legend)
        sections.append("<h2>correctness</h2>" + files_html(idx) + html_table(head, rows, CORRECTNESS_COLUMNS))

    for i in by_kind.get("compare", []):
        r = results[i]
        head, rows = compare_rows(r)
        show(console_tables(f"compare_all {all_labels[i]}", head, rows, width, priority=COMPARE_PRIORITY, wrap=("method",)))
        stem = Path(r["_path"]).stem
        ps = compare_plots(r, out, prefix=f"{stem}_{i}" if len(by_kind["compare"]) > 1 else stem)
        plots += ps
        sections.append(f"<h2>compare_all: {html.escape(all_labels[i])}</h2>" + files_html([i]) + html_table(head, rows, COMPARE_COLUMNS)
                        + figures(ps))

    for w in warnings:
        console.print(f"[bold yellow]warning:[/] {w}")
    page = None
    if html_page:
        page = out / "index.html"
        warn = "".join(f'<p class="warn">warning: {html.escape(w)}</p>' for w in warnings)
        atomic_write_text(page, f"<!doctype html><html><head><meta charset='utf-8'><title>selfspec report</title><style>{_CSS}</style></head>"
                                f"<body><h1>selfspec report</h1>{warn}{''.join(sections)}</body></html>\n")
    for p in plots:
        console.print(f"wrote {p}", soft_wrap=True)
    if page:
        console.print(f"wrote {page}", soft_wrap=True)
    return {"plots": [str(p) for p in plots], "html": str(page) if page else None, "warnings": warnings}


def sweep_loss_warning(r: dict) -> str | None:
    """A sweep's best setting measured slower than autoregressive decoding, said plainly."""
    best = r.get("best")
    if not best or best.get("speedup") is None or best["speedup"] >= 1.0:
        return None
    from selfspec.tools.bench import strategy_label

    return (f"the best setting, {strategy_label(best['draft'])}, is SLOWER than autoregressive decoding "
            f"(x{best['speedup']:.2f}): no setting of this sweep pays off; do not use it")
