"""`selfspec bench`: a drafting strategy against the autoregressive baseline on the same prompts.

For every prompt both are run back to back, the order alternating from prompt to prompt, so
machine drift (thermal state, other load) hits both alike. Each run is an ordinary
`SelfSpecModel.generate` call; its GenerationStats are the measurement.

Numbers (aggregate, per method; see `aggregate_runs`):
  tokens_per_second         sum of new tokens / sum of wall time (prefill included)
  speedup                   ratio of means: strategy tokens/s / baseline tokens/s, as above;
                            with greedy decoding both make the same tokens, so this is
                            sum(baseline time) / sum(strategy time)
  speedup_median            median over prompts of the per-prompt ratio
                            (strategy tokens/s / baseline tokens/s)
  acceptance_rate           accepted / drafted over all verify steps
  mean_accepted_length      (accepted + verify steps) / verify steps: tokens per full pass
  per_position_acceptance   accepted / drafted at draft position 1..K
  time split                prefill / draft / verify / other (sampling, bookkeeping), s and share
  time_to_first_token_s     mean and median
  peak memory               per method, MiB: CUDA max allocated (GPU); on the CPU the peak
                            resident set while that method ran (see MemoryMonitor)
  quality                   ROUGE-1/2/L F1 against references (rouge-score, stemmed), and for
                            code the share of completions that parse (see `code_parses`)
"""

from __future__ import annotations

import os
from collections.abc import Callable

from rich.table import Table

from selfspec.config import DraftConfig
from selfspec.tools.common import (
    FORMAT,
    ProgressBar,
    Settings,
    median_of,
    aggregate_runs,
    environment,
    measured_generate,
    model_info,
    now,
    run_record,
    strategy_label,
    warm_up,
    write_json,
)
from selfspec.tools.datasets import Dataset, Sample
from selfspec.tools.memory import MemoryMonitor, process_peak_rss_mb


def aggregate_pairs(samples: list[dict], peaks: dict | None = None) -> dict:
    """Aggregate of bench samples, each {"baseline": run, "strategy": run, ...}."""
    base = aggregate_runs([s["baseline"] for s in samples])
    strat = aggregate_runs([s["strategy"] for s in samples])
    if peaks:
        base["peak_memory_mb"] = peaks.get("baseline")
        strat["peak_memory_mb"] = peaks.get("strategy")
    ratios = [s["speedup"] for s in samples if s.get("speedup") is not None]
    return {
        "samples": len(samples),
        "baseline": base,
        "strategy": strat,
        "speedup": strat["tokens_per_second"] / base["tokens_per_second"] if base["tokens_per_second"] else None,
        "speedup_median": median_of(ratios),
        "speedup_min": min(ratios) if ratios else None,
        "speedup_max": max(ratios) if ratios else None,
        "identical_outputs": sum(1 for s in samples if s.get("identical")),
    }


def pair_record(sample: Sample, base: dict, strat: dict, order: str) -> dict:
    speed = strat["tokens_per_second"] / base["tokens_per_second"] if base["tokens_per_second"] else None
    return {
        "id": sample.id,
        "source": sample.source,
        "task": sample.task,
        "prompt": sample.prompt,
        "reference": sample.reference,
        "order": order,
        "baseline": base,
        "strategy": strat,
        "speedup": speed,
        "identical": base["token_ids"] == strat["token_ids"],
    }



def progress_status(base_runs: list[dict], strat_runs: list[dict]) -> str:
    b, s = aggregate_runs(base_runs), aggregate_runs(strat_runs)
    parts = [f"AR {b['tokens_per_second']:.1f} tok/s", f"spec {s['tokens_per_second']:.1f} tok/s"]
    if b["tokens_per_second"]:
        parts.append(f"x{s['tokens_per_second'] / b['tokens_per_second']:.2f}")
    if s["drafted"]:
        parts.append(f"acc {s['acceptance_rate']:.0%}")
    return " | ".join(parts)


# ---- the bench -------------------------------------------------------------------------------


def run_bench(
    model,
    draft: DraftConfig,
    dataset: Dataset,
    settings: Settings,
    *,
    warmup: int = 1,
    out: str | os.PathLike | None = None,
    progress: bool = True,
    command: list[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run the bench; the results dict (also written to `out` after every prompt, atomically).
    Ctrl-C stops after writing the prompts that finished (results["interrupted"] = True)."""
    baseline = DraftConfig("autoregressive")
    model.drafter(draft)  # validate against the model before any timing
    results = {
        "format": FORMAT,
        "kind": "bench",
        "created": now(),
        "command": command,
        "model": model_info(model),
        "strategy": draft.to_dict(),
        "strategy_label": strategy_label(draft),
        "baseline": baseline.to_dict(),
        "settings": {**settings.to_dict(), "warmup": warmup, "order": "alternating per prompt"},
        "dataset": dataset.info(),
        "environment": environment(),
        "requested": len(dataset.samples),
        "completed": 0,
        "interrupted": False,
        "samples": [],
        "aggregate": None,
    }
    memory = MemoryMonitor(str(model.runtime.device))
    results["memory_method"] = memory.method

    def save():
        results["completed"] = len(results["samples"])
        results["aggregate"] = aggregate_pairs(results["samples"], memory.peaks) if results["samples"] else None
        results["process_peak_rss_mb"] = process_peak_rss_mb()
        if out is not None:
            write_json(out, results)

    try:
        if warmup:
            if log:
                log(f"warming up ({warmup} untimed generation(s) of each)")
            warm_up(model, dataset, [baseline, draft], settings, warmup)
        with ProgressBar(len(dataset.samples), "bench", progress) as bar:
            for i, sample in enumerate(dataset.samples):
                seed = settings.seed + i
                order = ("baseline", "strategy") if i % 2 == 0 else ("strategy", "baseline")
                runs = {}
                for which in order:
                    cfg = baseline if which == "baseline" else draft
                    res = measured_generate(model, sample.prompt, cfg, settings, seed, memory, which)
                    runs[which] = run_record(res, sample)
                results["samples"].append(pair_record(sample, runs["baseline"], runs["strategy"], "/".join(order)))
                save()
                bar.update(1, progress_status([s["baseline"] for s in results["samples"]], [s["strategy"] for s in results["samples"]]))
    except KeyboardInterrupt:
        results["interrupted"] = True
    finally:
        memory.close()
    save()
    return results


# ---- tables ----------------------------------------------------------------------------------


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def bench_table(results: dict):
    agg = results.get("aggregate")
    m = results["model"]
    t = Table(title=f"selfspec bench: {results['strategy_label']} vs autoregressive - {m['name']} ({m['dtype']}, {m['device']}), "
                    f"{results['dataset']['name']} x{results['completed']}" + (" [interrupted]" if results.get("interrupted") else ""))
    t.add_column("")
    t.add_column("autoregressive", justify="right")
    t.add_column(results["strategy"]["strategy"], justify="right")
    if not agg:
        return t
    b, s = agg["baseline"], agg["strategy"]
    t.add_row("tokens/s (sum tok / sum time)", _f(b["tokens_per_second"]), _f(s["tokens_per_second"]))
    t.add_row("tokens/s (median prompt)", _f(b["tokens_per_second_median"]), _f(s["tokens_per_second_median"]))
    t.add_row("speedup (ratio of means)", "1.00", f"[bold]{_f(agg['speedup'])}x")
    t.add_row("speedup (median of per-prompt ratios)", "1.00", _f(agg["speedup_median"]) + "x")
    t.add_row("acceptance rate", "-", _f(s["acceptance_rate"], "{:.1%}"))
    t.add_row("mean accepted length (tokens/verify)", _f(b["mean_accepted_length"]), _f(s["mean_accepted_length"]))
    pp = s.get("per_position_acceptance") or []
    if pp:
        t.add_row("acceptance by draft position", "-", " ".join(_f(x, "{:.0%}") for x in pp))
    for k in ("prefill", "draft", "verify", "other"):
        t.add_row(f"time {k} (s, share)", f"{b['time_split_s'][k]:.2f} ({b['time_split_share'][k]:.0%})",
                  f"{s['time_split_s'][k]:.2f} ({s['time_split_share'][k]:.0%})")
    t.add_row("time to first token (mean s)", _f(b["time_to_first_token_s"], "{:.3f}"), _f(s["time_to_first_token_s"], "{:.3f}"))
    t.add_row("peak memory (MB)", _f(b.get("peak_memory_mb"), "{:.0f}"), _f(s.get("peak_memory_mb"), "{:.0f}"))
    if "rouge" in b:
        for k in ("rouge1", "rouge2", "rougeL"):
            t.add_row(k.upper().replace("ROUGEL", "ROUGE-L").replace("ROUGE1", "ROUGE-1").replace("ROUGE2", "ROUGE-2"),
                      _f(b["rouge"][k], "{:.3f}"), _f(s["rouge"][k], "{:.3f}"))
    if "code_parse_rate" in b:
        t.add_row("code parses", _f(b["code_parse_rate"], "{:.0%}"), _f(s["code_parse_rate"], "{:.0%}"))
    t.add_row("outputs identical to baseline", "-", f"{agg['identical_outputs']}/{agg['samples']}")
    return t
