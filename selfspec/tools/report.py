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
import os
from pathlib import Path

from rich.console import Console
from rich.text import Text

from selfspec.errors import SelfSpecError
from selfspec.profiles import atomic_write_text
from selfspec.tools.common import strategy_label
from selfspec.tools.plots import bench_plots, chart_text, compare_plots, sweep_plots
from selfspec.tools.tables import (
    BENCH_COLUMNS,
    BENCH_PRIORITY,
    COMPARE_COLUMNS,
    COMPARE_PRIORITY,
    CORRECTNESS_COLUMNS,
    CORRECTNESS_PRIORITY,
    SWEEP_COLUMNS,
    bench_rows,
    compare_rows,
    console_tables,
    correctness_rows,
    html_figure,
    html_table,
    machine_label,
    numbered,
    sweep_loss_warning,
    sweep_rows,
)

KINDS = ("bench", "sweep", "correctness", "compare")


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



# ---- the report ----------------------------------------------------------------------------------


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;margin:1em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right;white-space:nowrap}td:first-child,th:first-child{text-align:left}
th{background:#f3f3f3}.scroll{overflow-x:auto}img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}
figcaption{font-size:13px;color:#444;max-width:900px}dl.cols{font-size:13px;display:grid;grid-template-columns:max-content auto;gap:2px 12px}
dl.cols dt{font-weight:600}dl.cols dd{margin:0}.warn{color:#a40;font-weight:600}code{font-size:12px}"""


class _Page:
    """One report being written: the results, their labels, the console, and the plots,
    warnings and HTML sections gathered so far."""

    def __init__(self, results: list[dict], labels: list[str], out: Path, console):
        self.results, self.labels, self.out, self.console = results, labels, out, console
        self.plots: list[Path] = []
        self.warnings: list[str] = []
        self.sections: list[str] = []

    def files_html(self, idx: list[int]) -> str:
        rs = self.results
        return "<ul>" + "".join(
            f"<li><code>{html.escape(rs[i]['_path'])}</code>: {html.escape(self.labels[i])}; created {html.escape(str(rs[i].get('created')))}; "
            f"model {html.escape(rs[i]['model']['fingerprint'])}; torch {html.escape(str((rs[i].get('environment') or {}).get('versions', {}).get('torch')))}</li>"
            for i in idx) + "</ul>"

    def figures(self, ps: list[Path]) -> str:
        self.plots += ps
        return "".join(html_figure(p, chart_text(p)) for p in ps)

    def show(self, tables: list, legend: list[str] | None = None) -> None:
        for line in legend or ():
            self.console.print(Text(line), soft_wrap=False, overflow="fold")
        for t in tables:
            self.console.print(t)

    def stem(self, i: int, kind_count: int) -> str:
        stem = Path(self.results[i]["_path"]).stem
        return f"{stem}_{i}" if kind_count > 1 else stem


def _bench_section(page: _Page, idx: list[int]) -> None:
    rs, labs = [page.results[i] for i in idx], [page.labels[i] for i in idx]
    fps = {r["model"]["fingerprint"] for r in rs}
    hashes = {(r["dataset"]["name"], r["dataset"]["hash"]) for r in rs}
    if len(fps) > 1:
        page.warnings.append(f"bench runs used different models (fingerprints {', '.join(sorted(fps))})")
    if len({h for _, h in hashes}) > 1:
        page.warnings.append("bench runs used different prompts (dataset hashes differ: " + ", ".join(f"{n}:{h}" for n, h in sorted(hashes)) + ")")
    head, rows = bench_rows(rs, labs)
    cap = "speedup = ratio of mean throughput; median = of per-prompt ratios"
    ids, legend = numbered([r[0] for r in rows])
    page.show(console_tables("bench runs", head, [[k] + r[1:] for k, r in zip(ids, rows)], page.console.width, priority=BENCH_PRIORITY,
                             wrap=("model", "dataset"), caption=cap), ["runs:"] + legend)
    figs = page.figures(bench_plots(rs, labs, page.out))
    page.sections.append("<h2>bench</h2>" + page.files_html(idx) + html_table(head, rows, BENCH_COLUMNS) + figs)


def _sweep_section(page: _Page, i: int, count: int) -> None:
    r, label = page.results[i], page.labels[i]
    head, rows = sweep_rows(r)
    best = r.get("best")
    cap = "speedup / acceptance; * best" + (f": {strategy_label(best['draft'])} x{best['speedup']:.2f}" if best else "")
    loss = sweep_loss_warning(r)
    if loss:
        page.warnings.append(f"{label}: {loss}")
    page.show(console_tables(f"sweep {label}", head, rows, page.console.width, caption=cap))
    figs = page.figures(sweep_plots(r, page.out, prefix=page.stem(i, count)))
    page.sections.append(f"<h2>sweep: {html.escape(label)}</h2>" + page.files_html([i]) + html_table(head, rows)
                         + f"<p>{html.escape(cap)}. {html.escape(SWEEP_COLUMNS['cells'])}.</p>" + figs)


def _correctness_section(page: _Page, idx: list[int]) -> None:
    head, rows = correctness_rows([page.results[i] for i in idx], [page.labels[i] for i in idx])
    ids, legend = numbered([r[0] for r in rows])
    page.show(console_tables("correctness (greedy, token for token)", head, [[k] + r[1:] for k, r in zip(ids, rows)], page.console.width,
                             priority=CORRECTNESS_PRIORITY, wrap=("dataset", "mismatching ids")), ["runs:"] + legend)
    page.sections.append("<h2>correctness</h2>" + page.files_html(idx) + html_table(head, rows, CORRECTNESS_COLUMNS))


def _compare_section(page: _Page, i: int, count: int) -> None:
    r, label = page.results[i], page.labels[i]
    head, rows = compare_rows(r)
    page.show(console_tables(f"compare_all {label}", head, rows, page.console.width, priority=COMPARE_PRIORITY, wrap=("method",)))
    figs = page.figures(compare_plots(r, page.out, prefix=page.stem(i, count)))
    page.sections.append(f"<h2>compare_all: {html.escape(label)}</h2>" + page.files_html([i]) + html_table(head, rows, COMPARE_COLUMNS) + figs)


def shown_path(path: str | os.PathLike) -> str:
    """path relative to the working directory when it lies below it, else as given."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def _wrote(console, path) -> None:
    """"wrote PATH" on one line when it fits the console, else the path on a line of its own
    (never wrapped inside: it stays one string to copy)."""
    shown = shown_path(path)
    if len("wrote " + shown) <= console.width:
        console.print(f"wrote {shown}", soft_wrap=True, highlight=False)
    else:
        console.print("wrote", highlight=False)
        console.print(f"  {shown}", soft_wrap=True, highlight=False)


def report(paths: list[str], out_dir: str | os.PathLike = "report", labels: list[str] | None = None, html_page: bool = True, console=None) -> dict:
    """Print tables (fitted to the console's width), write plots (and index.html, with every
    column) to out_dir. -> {"plots": [...], "html": path|None, "warnings": [...]}"""
    if not paths:
        raise SelfSpecError("report needs at least one results file")
    results = [load_results(p) for p in paths]
    console = console if console is not None else Console()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    page = _Page(results, run_labels(results, labels), out, console)
    by_kind: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        by_kind.setdefault(r["kind"], []).append(i)
    if "bench" in by_kind:
        _bench_section(page, by_kind["bench"])
    for i in by_kind.get("sweep", []):
        _sweep_section(page, i, len(by_kind["sweep"]))
    if "correctness" in by_kind:
        _correctness_section(page, by_kind["correctness"])
    for i in by_kind.get("compare", []):
        _compare_section(page, i, len(by_kind["compare"]))

    for w in page.warnings:
        console.print(f"[bold yellow]warning:[/] {w}")
    index = None
    if html_page:
        index = out / "index.html"
        warn = "".join(f'<p class="warn">warning: {html.escape(w)}</p>' for w in page.warnings)
        atomic_write_text(index, f"<!doctype html><html><head><meta charset='utf-8'><title>selfspec report</title><style>{_CSS}</style></head>"
                                 f"<body><h1>selfspec report</h1>{warn}{''.join(page.sections)}</body></html>\n")
    for p in page.plots + ([index] if index else []):
        _wrote(console, p)
    return {"plots": [str(p) for p in page.plots], "html": str(index) if index else None, "warnings": page.warnings}
