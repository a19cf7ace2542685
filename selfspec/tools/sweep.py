"""`selfspec sweep`: a grid of draft configurations, each measured against autoregressive.

    early-exit:  rows = exit layers      (--exit-layers 4:16:2), columns = K (--num-speculations 1:8)
    layer-skip:  rows = skip ratios      (--skip-ratios 0.1:0.5:0.1), columns = K

Ranges are `start:stop[:step]` with both ends included, or comma lists ("2,4,8").

A skip ratio r drafts with round(r * L) of the L layers skipped, spread evenly over the
interior layers 1..L-2 (the first and last layers always run); --skip-kind chooses whether
a skipped layer loses its attention, its MLP, or both sub-layers. It is a simple,
reproducible family of skip sets, not a search.

Measurement order: for each row, for each prompt, the baseline runs once and then every K
of that row (K order rotating from prompt to prompt); a cell's speedup is against the
baseline runs of its own row and prompts, so drift over a long sweep hits both sides.

Writes to --out-dir: sweep.json (everything, per-prompt numbers included), sweep.csv (one
line per cell), sweep_heatmap.png (speedup over row x K, best cell marked),
sweep_acceptance.png (acceptance rate by row, one line per K), and the best cell as a
draft profile (best_profile.json, or --profile-out) for `--profile`. When even the best cell
is slower than autoregressive decoding, the sweep says so loudly and the profile is marked
`slower_than_autoregressive`: `--strategy auto` never adopts it and install refuses it.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from selfspec.config import MAX_SPECULATIONS, DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.profiles import Profile, atomic_write_text, save_profile
from rich.console import Group

from selfspec.tools.common import (
    FORMAT,
    ProgressBar,
    Settings,
    aggregate_runs,
    environment,
    measured_generate,
    median_of,
    model_info,
    now,
    run_record,
    warm_up,
    write_json,
)
from selfspec.tools.datasets import Dataset
from selfspec.tools.memory import MemoryMonitor, process_peak_rss_mb
from selfspec.tools.plots import sweep_plots
from selfspec.tools.tables import console_tables, sweep_loss_warning, sweep_rows

CSV_FIELDS = [
    "strategy", "row", "exit_layer", "skip_ratio", "draft_bits", "skip_attn", "skip_mlp", "num_speculations", "samples", "complete",
    "tokens_per_second", "baseline_tokens_per_second", "speedup", "speedup_median", "acceptance_rate",
    "mean_accepted_length", "drafted", "accepted", "verify_steps", "time_s", "baseline_time_s", "identical_outputs",
]


def parse_int_range(text: str, what: str) -> list[int]:
    try:
        if ":" in text:
            parts = [int(p) for p in text.split(":")]
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] <= 0):
                raise ValueError
            start, stop, step = parts[0], parts[1], parts[2] if len(parts) == 3 else 1
            vals = list(range(start, stop + 1, step))
        else:
            vals = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError as e:
        raise SelfSpecError(f"{what}: expected start:stop[:step] or a comma list of integers, got {text!r}") from e
    if not vals:
        raise SelfSpecError(f"{what}: the range {text!r} is empty")
    return vals


def parse_float_range(text: str, what: str) -> list[float]:
    try:
        if ":" in text:
            parts = [float(p) for p in text.split(":")]
            if len(parts) not in (2, 3):
                raise ValueError
            start, stop = parts[0], parts[1]
            step = parts[2] if len(parts) == 3 else 0.1
            if step <= 0:
                raise ValueError
            vals, i = [], 0
            while start + i * step <= stop + 1e-9:
                vals.append(round(start + i * step, 6))
                i += 1
        else:
            vals = sorted({float(p) for p in text.split(",") if p.strip()})
    except ValueError as e:
        raise SelfSpecError(f"{what}: expected start:stop[:step] or a comma list of numbers, got {text!r}") from e
    if not vals:
        raise SelfSpecError(f"{what}: the range {text!r} is empty")
    if any(not 0 < v < 1 for v in vals):
        raise SelfSpecError(f"{what}: skip ratios must be in (0, 1), got {vals}")
    return vals


def skip_layers(num_layers: int, ratio: float) -> tuple[int, ...]:
    """round(ratio * L) layers spread evenly over the interior layers 1..L-2."""
    interior = list(range(1, num_layers - 1)) or list(range(num_layers))
    n = min(max(1, round(ratio * num_layers)), len(interior))
    if n == 1:
        return (interior[len(interior) // 2],)
    return tuple(sorted({interior[round(i * (len(interior) - 1) / (n - 1))] for i in range(n)}))


SWEPT = ("early-exit", "layer-skip", "exit-adapter", "quantized")


def row_kind(strategy: str) -> str:
    """What a sweep row varies: the exit layer, the skip ratio or the quantized copy's bits."""
    return {"early-exit": "exit_layer", "exit-adapter": "exit_layer", "layer-skip": "skip_ratio", "quantized": "draft_bits"}[strategy]


ROW_LABEL = {"exit_layer": "E", "skip_ratio": "skip", "draft_bits": "bits"}  # progress line


def row_draft(strategy: str, row, K: int, num_layers: int, skip_kind: str, extra: dict) -> DraftConfig:
    if strategy in ("early-exit", "exit-adapter"):
        return DraftConfig(strategy=strategy, exit_layer=int(row), num_speculations=K, **extra)
    if strategy == "quantized":  # the whole depth in `row` bits (its head too unless head_bits is fixed)
        return DraftConfig(strategy=strategy, draft_bits=int(row), num_speculations=K, **extra)
    layers = skip_layers(num_layers, float(row))
    attn = layers if skip_kind in ("attn", "both") else ()
    mlp = layers if skip_kind in ("mlp", "both") else ()
    return DraftConfig(strategy="layer-skip", skip_attn=attn, skip_mlp=mlp, num_speculations=K, **extra)


def _slim(rec: dict) -> dict:
    rec = dict(rec)
    rec.pop("token_ids", None)
    rec.pop("text", None)
    return rec


def cell_summary(cell: dict, baseline_runs: dict) -> dict:
    """Aggregate a cell against the baseline runs of the same prompts."""
    runs = cell["samples"]
    base = [baseline_runs[r["id"]] for r in runs if r["id"] in baseline_runs]
    s, b = aggregate_runs(runs), aggregate_runs(base)
    ratios = [
        r["tokens_per_second"] / baseline_runs[r["id"]]["tokens_per_second"]
        for r in runs
        if r["id"] in baseline_runs and baseline_runs[r["id"]]["tokens_per_second"]
    ]
    return {
        "samples": len(runs),
        "tokens_per_second": s["tokens_per_second"],
        "baseline_tokens_per_second": b["tokens_per_second"],
        "speedup": s["tokens_per_second"] / b["tokens_per_second"] if runs and b["tokens_per_second"] else None,
        "speedup_median": median_of(ratios),
        "acceptance_rate": s["acceptance_rate"],
        "mean_accepted_length": s["mean_accepted_length"],
        "per_position_acceptance": s["per_position_acceptance"],
        "drafted": s["drafted"],
        "accepted": s["accepted"],
        "verify_steps": s["verify_steps"],
        "time_s": s["time_s"],
        "baseline_time_s": b["time_s"],
        "time_split_s": s["time_split_s"],
        "identical_outputs": sum(1 for r in runs if r.get("identical")),
    }


def best_cell(cells: list[dict], requested: int) -> dict | None:
    done = [c for c in cells if c["summary"]["speedup"] is not None]
    complete = [c for c in done if c["summary"]["samples"] == requested]
    pool = complete or done
    return max(pool, key=lambda c: c["summary"]["speedup"]) if pool else None


def csv_text(results: dict) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for c in results["cells"]:
        d, s = c["draft"], c["summary"]
        w.writerow({
            "strategy": d["strategy"],
            "row": c["row"],
            "exit_layer": d.get("exit_layer") if d["strategy"] in ("early-exit", "exit-adapter") else "",
            "skip_ratio": c["row"] if d["strategy"] == "layer-skip" else "",
            "draft_bits": d.get("draft_bits") if d["strategy"] == "quantized" else "",
            "skip_attn": " ".join(map(str, d.get("skip_attn") or [])),
            "skip_mlp": " ".join(map(str, d.get("skip_mlp") or [])),
            "num_speculations": d["num_speculations"],
            "samples": s["samples"],
            "complete": s["samples"] == results["requested"],
            **{k: s[k] for k in CSV_FIELDS[10:]},
        })
    return buf.getvalue()


def sweep_grid(model, strategy: str, rows: list, ks: list[int], skip_kind: str, extra: dict) -> dict:
    """{(row, K): DraftConfig}, every cell checked against the model before anything runs."""
    if strategy not in SWEPT:
        raise SelfSpecError(f"sweep covers {', '.join(SWEPT)}, not {strategy!r}")
    bad = [k for k in ks if not 1 <= k <= MAX_SPECULATIONS]
    if bad:
        raise SelfSpecError(f"--num-speculations: K must be in 1..{MAX_SPECULATIONS}, got {bad}")
    L = model.spec.num_layers
    grid = {(row, K): row_draft(strategy, row, K, L, skip_kind, extra) for row in rows for K in ks}
    for cfg in grid.values():
        cfg.check_model(L, model.spec.vocab_size)
    return grid


def _new_results(model, strategy, rows, ks, grid, dataset, settings, skip_kind, extra, warmup, command) -> dict:
    return {
        "format": FORMAT,
        "kind": "sweep",
        "created": now(),
        "command": command,
        "model": model_info(model),
        "strategy": strategy,
        "row_kind": row_kind(strategy),
        "rows": rows,
        "num_speculations": ks,
        "skip_kind": skip_kind if strategy == "layer-skip" else None,
        "fixed_options": extra,
        "settings": {**settings.to_dict(), "warmup": warmup, "order": "per row: per prompt, baseline then each K (rotating)"},
        "dataset": dataset.info(),
        "environment": environment(),
        "requested": len(dataset.samples),
        "interrupted": False,
        "baseline": {str(r): [] for r in rows},
        "cells": [{"row": r, "draft": grid[(r, K)].to_dict(), "samples": [], "summary": None} for r in rows for K in ks],
        "best": None,
    }


def summarize(results: dict, memory: MemoryMonitor) -> None:
    """Every cell's summary and the best cell, from the runs so far."""
    for c in results["cells"]:
        base = {r["id"]: r for r in results["baseline"][str(c["row"])]}
        c["summary"] = cell_summary(c, base)
    best = best_cell(results["cells"], results["requested"])
    results["best"] = None if best is None else {"row": best["row"], "draft": best["draft"], **best["summary"],
                                                 "slower_than_autoregressive": best["summary"]["speedup"] < 1.0}
    results["peak_memory_mb"] = dict(memory.peaks)
    results["process_peak_rss_mb"] = process_peak_rss_mb()


def _measure_row(model, results: dict, row, grid: dict, dataset: Dataset, settings: Settings, memory: MemoryMonitor, bar, save) -> None:
    """For each prompt: the baseline once, then every K of the row (K order rotating)."""
    baseline = DraftConfig("autoregressive")
    ks = results["num_speculations"]
    cells = {(c["row"], c["draft"]["num_speculations"]): c for c in results["cells"]}
    label = f"{ROW_LABEL[results['row_kind']]}={row}"
    for i, sample in enumerate(dataset.samples):
        seed = settings.seed + i
        res = measured_generate(model, sample.prompt, baseline, settings, seed, memory, "baseline")
        base = run_record(res, None, keep_text=False)
        results["baseline"][str(row)].append({"id": sample.id, **_slim(base)})
        bar.update(1, description=f"sweep {label}")
        for K in ks[i % len(ks):] + ks[: i % len(ks)]:
            res = measured_generate(model, sample.prompt, grid[(row, K)], settings, seed, memory, "strategy")
            rec = run_record(res, None, keep_text=False)
            cells[(row, K)]["samples"].append({"id": sample.id, "identical": rec["token_ids"] == base["token_ids"], **_slim(rec)})
            bar.update(1)
        save()
        best = results["best"]
        if best is not None:
            bar.update(0, status=f"best so far x{best['speedup']:.2f} ({label.split('=')[0]}={best['row']}, K={best['draft']['num_speculations']}, acc {best['acceptance_rate']:.0%})")


def best_profile(model, results: dict, dataset: Dataset, settings: Settings) -> Profile:
    """The best cell as a draft profile, with what it was measured on."""
    best = results["best"]
    metrics = {k: best[k] for k in ("speedup", "speedup_median", "acceptance_rate", "mean_accepted_length", "tokens_per_second", "baseline_tokens_per_second", "samples")}
    metrics.update({
        "speedup_vs_autoregressive": best["speedup"],
        # auto and install read this: a best setting that loses is a result, not a recommendation
        "slower_than_autoregressive": best["speedup"] is not None and best["speedup"] < 1.0,
        "dataset": dataset.name,
        "dataset_hash": dataset.hash,
        "max_new_tokens": settings.max_new_tokens,
        "temperature": settings.temperature,
        "dtype": results["model"]["dtype"],
        "device": results["model"]["device"],
        "machine": results["environment"].get("gpu") or results["environment"].get("cpu"),
        "source": "selfspec sweep",
        "created": results["created"],
    })
    return Profile(DraftConfig.from_dict(best["draft"]), model.fingerprint, model.name, metrics)


def run_sweep(
    model,
    strategy: str,
    rows: list,
    ks: list[int],
    dataset: Dataset,
    settings: Settings,
    *,
    skip_kind: str = "both",
    extra: dict | None = None,
    warmup: int = 1,
    out_dir: str | os.PathLike | None = None,
    profile_out: str | os.PathLike | None = None,
    progress: bool = True,
    command: list[str] | None = None,
    log=None,
) -> dict:
    extra = {k: v for k, v in (extra or {}).items() if v is not None}
    grid = sweep_grid(model, strategy, rows, ks, skip_kind, extra)
    out_dir = Path(out_dir) if out_dir is not None else None
    results = _new_results(model, strategy, rows, ks, grid, dataset, settings, skip_kind, extra, warmup, command)
    memory = MemoryMonitor(str(model.runtime.device))
    results["memory_method"] = memory.method

    def save():
        summarize(results, memory)
        if out_dir is not None:
            write_json(out_dir / "sweep.json", results)
            atomic_write_text(out_dir / "sweep.csv", csv_text(results))

    try:
        if warmup:
            if log:
                log(f"warming up ({warmup} untimed generation(s) each of the baseline and the first cell)")
            warm_up(model, dataset, [DraftConfig("autoregressive"), grid[(rows[0], ks[0])]], settings, warmup)
        with ProgressBar(len(rows) * len(dataset.samples) * (1 + len(ks)), "sweep", progress) as bar:
            for row in rows:
                _measure_row(model, results, row, grid, dataset, settings, memory, bar, save)
    except KeyboardInterrupt:
        results["interrupted"] = True
    finally:
        memory.close()
    save()
    if out_dir is not None:
        results["plots"] = [str(p) for p in sweep_plots(results, out_dir)]
        write_json(out_dir / "sweep.json", results)
    if results["best"] is not None and (profile_out is not None or out_dir is not None):
        path = Path(profile_out) if profile_out is not None else out_dir / "best_profile.json"
        save_profile(best_profile(model, results, dataset, settings), path)
        results["profile"] = str(path)
        if out_dir is not None:
            write_json(out_dir / "sweep.json", results)
    return results


def sweep_table(results: dict, width: int = 160):
    """The grid as it fits a console `width` columns wide (split into several tables when
    there are too many K for one), best cell starred; a best cell slower than plain
    decoding is said so in the caption."""
    m = results["model"]
    title = (f"selfspec sweep: {results['strategy']} speedup vs autoregressive - {m['name']} ({m['dtype']}, {m['device']}), "
             f"{results['dataset']['name']} x{results['requested']}" + (" [interrupted]" if results.get("interrupted") else ""))
    head, rows = sweep_rows(results)
    caption = "cells: speedup (ratio of means) / acceptance rate; * best"
    loss = sweep_loss_warning(results)
    if loss:
        caption += f". WARNING: {loss}"
    return Group(*console_tables(title, head, rows, width, caption=caption))
