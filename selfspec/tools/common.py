"""What bench, sweep and correctness share: the results-file conventions (format, provenance,
strict JSON), one measured generation and its record, the aggregate of records, and the
progress bar. See bench.py for what the numbers mean."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import json
import math
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from selfspec import kernels
from selfspec.config import DraftConfig, SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec.profiles import atomic_write_text
from selfspec.tools.datasets import Dataset, Sample
from selfspec.tools.memory import MemoryMonitor
from selfspec.tools.quality import code_parses, rouge

FORMAT = "selfspec-results/1"


# ---- provenance ------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
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
        import psutil  # optional: not a dependency

        env["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:  # building the kernels may fail; the environment is still worth recording
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
        "memory": model.memory(),
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


# ---- one measured generation -----------------------------------------------------------------


@dataclass
class Settings:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    coupling: str = SamplingConfig.coupling

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def run_record(result, sample: Sample | None = None, keep_text: bool = True) -> dict:
    """The numbers of one GenerationResult, as stored in results files: its stats
    (GenerationStats.to_dict), the finish reason and the tokens, and with keep_text the text
    and its quality against the sample."""
    rec = {**result.stats.to_dict(), "finish_reason": result.finish_reason, "token_ids": list(result.token_ids)}
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
            coupling=settings.coupling,
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


def mean_of(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def median_of(xs):
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
        "tokens_per_second_mean": mean_of([r["tokens_per_second"] for r in runs]),
        "tokens_per_second_median": median_of([r["tokens_per_second"] for r in runs]),
        "time_to_first_token_s": mean_of([r["time_to_first_token_s"] for r in runs]),
        "time_to_first_token_s_median": median_of([r["time_to_first_token_s"] for r in runs]),
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
        out["rouge"] = {k: mean_of([x[k] for x in rouges]) for k in ("rouge1", "rouge2", "rougeL")}
        out["rouge_samples"] = len(rouges)
    parses = [r["code_parses"] for r in runs if "code_parses" in r]
    if parses:
        out["code_parse_rate"] = sum(parses) / len(parses)
        out["code_samples"] = len(parses)
    return out


# ---- progress --------------------------------------------------------------------------------


class ProgressBar:
    """A rich progress bar on stderr with a free-text status (tokens/s, acceptance so far)."""

    def __init__(self, total: int, description: str, enabled: bool = True):
        self.enabled = enabled
        self._p = None
        if enabled:
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
