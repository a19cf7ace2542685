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

import ast
import datetime as _dt
import json
import math
import os
import platform
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.profiles import atomic_write_text
from selfspec.tools.datasets import Dataset, Sample

FORMAT = "selfspec-results/1"


# ---- provenance ------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        import importlib.metadata as md

        return md.version(dist)
    except Exception:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Library versions and the machine, so runs on different machines can be compared."""
    import torch

    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda,
        "versions": {d: _version(d) for d in ("selfspec", "torch", "transformers", "tokenizers", "numpy", "rouge-score", "matplotlib", "rich")},
    }
    try:
        import psutil

        env["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        from selfspec import kernels

        env["selfspec_kernels"] = bool(kernels.available())
    except Exception:
        pass
    return env


def model_info(model) -> dict:
    rt = model.runtime
    return {
        "name": model.name,
        "fingerprint": model.fingerprint,
        "dtype": str(rt.dtype).replace("torch.", ""),
        "device": str(rt.device),
        "model_type": model.spec.model_type,
        "num_layers": model.spec.num_layers,
        "vocab_size": model.spec.vocab_size,
    }


def strategy_label(d: dict | DraftConfig) -> str:
    """DraftConfig.label() of a configuration or its saved dict (older result files: the
    strategy name when the dict no longer makes a valid configuration)."""
    if isinstance(d, DraftConfig):
        return d.label()
    try:
        return DraftConfig.from_dict(d).label()
    except (SelfSpecError, TypeError):
        return str(d.get("strategy", "?"))


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def _finite(x):
    """Non-finite floats -> None, so the files are strict JSON (no NaN / Infinity)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str | os.PathLike, data: dict) -> None:
    atomic_write_text(path, json.dumps(_finite(data), indent=1, ensure_ascii=False, allow_nan=False) + "\n")


# ---- memory ----------------------------------------------------------------------------------


class MemoryMonitor:
    """Peak memory per labelled window (e.g. "baseline" / "strategy"), in MiB.

    CUDA: torch.cuda.max_memory_allocated, reset per window. CPU, best first: Linux's
    resident high-water mark (VmHWM in /proc/self/status, reset per window by writing 5 to
    /proc/self/clear_refs: exact and free); else psutil's RSS sampled every 10 ms by a
    thread; else the process's ru_maxrss (a peak since start, not per window)."""

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.peaks: dict[str, float] = {}
        self._label: str | None = None
        self._wake = threading.Event()
        self._stop = False
        self._proc = None
        self._hwm = False
        if self.cuda:
            self.method = "torch.cuda.max_memory_allocated (per run)"
        elif _reset_hwm():
            self._hwm = True
            self.method = "peak RSS per run (Linux VmHWM, reset with /proc/self/clear_refs)"
        else:
            try:
                import psutil

                self._proc = psutil.Process()
                self.method = "peak RSS while running (psutil, 10 ms samples)"
                threading.Thread(target=self._poll, daemon=True).start()
            except ImportError:
                self.method = "process peak RSS since start (ru_maxrss)"

    def _poll(self) -> None:
        while not self._stop:
            self._wake.wait()
            label = self._label
            if label is not None:
                self._note(label, self._rss())
            time.sleep(0.01)

    def _rss(self) -> float:
        try:
            return self._proc.memory_info().rss / 2**20
        except Exception:
            return 0.0

    def _note(self, label: str, mb: float) -> None:
        if mb > self.peaks.get(label, 0.0):
            self.peaks[label] = mb

    def start(self, label: str) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self._hwm:
            _reset_hwm()
        elif self._proc is not None:
            self._note(label, self._rss())
            self._label = label
            self._wake.set()

    def stop(self, label: str) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self._note(label, torch.cuda.max_memory_allocated() / 2**20)
        elif self._hwm:
            self._note(label, _read_hwm_mb() or 0.0)
        elif self._proc is not None:
            self._wake.clear()
            self._label = None
            self._note(label, self._rss())
        else:
            self._note(label, process_peak_rss_mb())

    def close(self) -> None:
        self._stop = True
        self._wake.set()


def _reset_hwm() -> bool:
    """Reset Linux's resident high-water mark to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _read_hwm_mb() is not None
    except OSError:
        return False


def _read_hwm_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_peak_rss_mb() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 2**10  # bytes on macOS, KiB on Linux


# ---- quality ---------------------------------------------------------------------------------

_scorer = None


def rouge(reference: str, text: str) -> dict:
    global _scorer
    if _scorer is None:
        try:
            from rouge_score import rouge_scorer
        except ImportError as e:
            raise SelfSpecError("ROUGE needs the rouge-score package (pip install rouge-score)") from e
        _scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    s = _scorer.score(reference, text)
    return {k: s[k].fmeasure for k in ("rouge1", "rouge2", "rougeL")}


def _function_end(prompt: str, completion: str) -> str:
    """The completion up to where the prompt's function ends: the first non-blank line
    indented no deeper than the prompt's last `def` (HumanEval-style stop)."""
    indent = 0
    for line in prompt.splitlines():
        if line.lstrip().startswith(("def ", "async def ")):
            indent = len(line) - len(line.lstrip())
    text = prompt + completion
    start = len(prompt)
    lines = text[start:].split("\n")
    out = []
    for i, line in enumerate(lines):
        # the first piece continues the prompt's last line; later ones are whole lines
        if i > 0 and line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        out.append(line)
    return "\n".join(out)


def code_parses(prompt: str, completion: str, truncated: bool) -> bool:
    """Does prompt + completion parse as Python? The completion is cut where the function
    ends; when the token budget cut the output, its last, unfinished line is dropped."""
    body = _function_end(prompt, completion)
    candidates = [body]
    if truncated and "\n" in body.rstrip("\n"):
        candidates.append(body.rstrip("\n").rsplit("\n", 1)[0])
    for c in candidates:
        try:
            ast.parse(prompt + c + "\n")
            return True
        except (SyntaxError, ValueError):
            continue
    return False


# ---- one measured generation -----------------------------------------------------------------


@dataclass
class Settings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def run_record(result, sample: Sample | None = None, keep_text: bool = True) -> dict:
    """The numbers of one GenerationResult, as stored in results files."""
    s = result.stats
    rec = {
        "new_tokens": s.new_tokens,
        "prompt_tokens": s.prompt_tokens,
        "finish_reason": result.finish_reason,
        "time_s": s.time_s,
        "tokens_per_second": s.tokens_per_second,
        "time_to_first_token_s": s.time_to_first_token_s,
        "time_prefill_s": s.time_prefill_s,
        "time_draft_s": s.time_draft_s,
        "time_verify_s": s.time_verify_s,
        "time_other_s": s.time_other_s,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "verify_steps": s.verify_steps,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,
        "per_position_drafted": list(s.per_position_drafted),
        "per_position_accepted": list(s.per_position_accepted),
        "token_ids": list(result.token_ids),
    }
    if keep_text:
        rec["text"] = result.text
    if sample is not None and keep_text:
        if sample.reference:
            rec["rouge"] = rouge(sample.reference, result.text)
        if sample.task == "code":
            rec["code_parses"] = code_parses(sample.prompt, result.text, result.finish_reason == "length")
    return rec


def measured_generate(model, prompt: str, draft: DraftConfig, settings: Settings, seed: int, memory: MemoryMonitor | None = None, label: str = ""):
    if memory is not None:
        memory.start(label)
    try:
        return model.generate(
            prompt,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            seed=seed,
            draft=draft,
        )
    finally:
        if memory is not None:
            memory.stop(label)


def warm_up(model, dataset: Dataset, drafts: list[DraftConfig], settings: Settings, n: int) -> None:
    """n untimed generations of each configuration, longest prompts first: the first run at
    the largest cache size of the set pays one-time costs (rotary tables, allocator growth)
    that would otherwise land on whichever method met that size first."""
    prompts = sorted((s.prompt for s in dataset.samples), key=len, reverse=True)
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        for d in drafts:
            measured_generate(model, prompt, d, settings, settings.seed + i)


# ---- aggregation -----------------------------------------------------------------------------


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate_runs(runs: list[dict]) -> dict:
    """Totals and ratios over run records of one method."""
    tok = sum(r["new_tokens"] for r in runs)
    t = sum(r["time_s"] for r in runs)
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    steps = sum(r["verify_steps"] for r in runs)
    K = max((len(r["per_position_drafted"]) for r in runs), default=0)
    pd_ = [sum(r["per_position_drafted"][i] for r in runs if i < len(r["per_position_drafted"])) for i in range(K)]
    pa_ = [sum(r["per_position_accepted"][i] for r in runs if i < len(r["per_position_accepted"])) for i in range(K)]
    split = {k: sum(r[f"time_{k}_s"] for r in runs) for k in ("prefill", "draft", "verify", "other")}
    out = {
        "runs": len(runs),
        "new_tokens": tok,
        "time_s": t,
        "tokens_per_second": tok / t if t > 0 else 0.0,
        "tokens_per_second_mean": _mean([r["tokens_per_second"] for r in runs]),
        "tokens_per_second_median": _median([r["tokens_per_second"] for r in runs]),
        "time_to_first_token_s": _mean([r["time_to_first_token_s"] for r in runs]),
        "time_to_first_token_s_median": _median([r["time_to_first_token_s"] for r in runs]),
        "drafted": drafted,
        "accepted": accepted,
        "verify_steps": steps,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
        "per_position_drafted": pd_,
        "per_position_accepted": pa_,
        "per_position_acceptance": [a / d if d else None for a, d in zip(pa_, pd_)],
        "time_split_s": split,
        "time_split_share": {k: (v / t if t > 0 else 0.0) for k, v in split.items()},
    }
    rouges = [r["rouge"] for r in runs if "rouge" in r]
    if rouges:
        out["rouge"] = {k: _mean([x[k] for x in rouges]) for k in ("rouge1", "rouge2", "rougeL")}
        out["rouge_samples"] = len(rouges)
    parses = [r["code_parses"] for r in runs if "code_parses" in r]
    if parses:
        out["code_parse_rate"] = sum(parses) / len(parses)
        out["code_samples"] = len(parses)
    return out


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
        "speedup_median": _median(ratios),
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


# ---- progress --------------------------------------------------------------------------------


class ProgressBar:
    """A rich progress bar on stderr with a free-text status (tokens/s, acceptance so far)."""

    def __init__(self, total: int, description: str, enabled: bool = True):
        self.enabled = enabled
        self._p = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._p = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=Console(stderr=True),
                transient=False,
            )
            self._task = self._p.add_task(description, total=total, status="")

    def __enter__(self):
        if self._p is not None:
            self._p.start()
        return self

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.stop()
        return False

    def update(self, advance: int = 1, status: str | None = None, description: str | None = None) -> None:
        if self._p is not None:
            kw = {"advance": advance}
            if status is not None:
                kw["status"] = status
            if description is not None:
                kw["description"] = description
            self._p.update(self._task, **kw)


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
    from rich.table import Table

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
