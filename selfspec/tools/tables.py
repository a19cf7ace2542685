"""Tables of saved results (bench, sweep, correctness, compare_all): the rows, shared by the
console and the HTML page; console tables that fit the terminal; HTML tables with what each
column means."""

from __future__ import annotations

import html
import math
from pathlib import Path

from rich.table import Table

from selfspec.tools.common import strategy_label


def machine_label(r: dict) -> str:
    env = r.get("environment") or {}
    dev = env.get("gpu") if str(r.get("model", {}).get("device", "cpu")).startswith("cuda") else env.get("cpu")
    dev = (dev or "?").replace("(R)", "").replace("(TM)", "").replace(" CPU", "")
    if len(dev) > 28:
        dev = dev[:27] + "…"
    return f"{env.get('hostname', '?')} · {dev} · {env.get('torch_threads', '?')}t"



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
    rk = {"exit_layer": "exit layer", "draft_bits": "draft bits"}.get(r["row_kind"], "skip ratio")
    head = [f"{rk} \\ K"] + [str(k) for k in r["num_speculations"]]
    best = r.get("best") or {}
    rows = []
    for row in r["rows"]:
        line = [str(row)]
        for K in r["num_speculations"]:
            c = cell(r, row, K)
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


BENCH_PRIORITY = ["run", "speedup", "spec tok/s", "AR tok/s", "acceptance", "identical", "tokens/verify", "median", "n",
                  "TTFT AR/spec (s)", "draft/verify share", "dataset", "peak MB", "ROUGE-L", "parses", "model"]
COMPARE_PRIORITY = ["method", "dataset", "vs selfspec AR", "tok/s", "acceptance", "same tokens as AR", "vs HF generate", "n"]
CORRECTNESS_PRIORITY = ["run", "mismatches", "prompts", "first difference", "dataset", "mismatching ids"]


def cell(r: dict, row, K):
    for c in r["cells"]:
        if c["row"] == row and c["draft"]["num_speculations"] == K:
            return c
    return None



def sweep_loss_warning(r: dict) -> str | None:
    """A sweep's best setting measured slower than autoregressive decoding, said plainly."""
    best = r.get("best")
    if not best or best.get("speedup") is None or best["speedup"] >= 1.0:
        return None
    return (f"the best setting, {strategy_label(best['draft'])}, is SLOWER than autoregressive decoding "
            f"(x{best['speedup']:.2f}): no setting of this sweep pays off; do not use it")
