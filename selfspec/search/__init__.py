"""Draft search: Bayesian optimisation (Optuna TPE) of how a model drafts for itself.

    selfspec search --model M --n-trials 80 --out-dir search/ [--storage sqlite:///study.db] [--workers 2]

Search space (define-by-run, so each strategy only samples its own parameters):
  strategy       early-exit | layer-skip | prompt-lookup | exit-adapter (with --adapter)
  exit_layer     early-exit: 1..L-1 (exit-adapter: the adapter's)
  skip sets      layer-skip: how many attention / MLP sub-layers to skip, and which (the
                 n with the highest per-layer priorities; Draft & Verify's space)
  K or gamma     a fixed draft length 1..8, or a confidence threshold with K = 8
  draft_vocab    8k / 16k / 32k most frequent tokens, or the full vocabulary
  lookup_first   self-drafting strategies: take a prompt-lookup match first when there is one

Objective (the speed, never acceptance alone: skipping nothing accepts everything and is
slower than plain decoding):
  predicted (default)  speedup.simulate over teacher-forced greedy continuations of the
                       calibration prompts, with primitive costs measured once: a trial is
                       one cheap pass, and free of timing noise;
  measured             real generations of the calibration prompts, tokens/s over plain
                       decoding's (Draft & Verify's objective).
The winner is confirmed by measurement (plain vs drafted, interleaved, outputs compared)
and written as a draft profile for generate / bench / serve --profile.

Studies live in any Optuna storage URL, so a search resumes where it stopped and any
number of processes or machines can work on one study; `--workers N` starts N local
processes on the same storage.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.predictor.calibrate import teacher_forced
from selfspec.predictor.costs import CostModel
from selfspec.predictor.simulate import Prediction, simulate, simulate_lookup

STRATEGIES = ("early-exit", "layer-skip", "prompt-lookup", "exit-adapter")
OBJECTIVES = ("predicted", "measured")
DRAFT_VOCABS = (8192, 16384, 32768)
MAX_K = 8


@dataclass(frozen=True)
class SearchConfig:
    strategies: tuple[str, ...] = ("early-exit", "layer-skip", "prompt-lookup")
    n_trials: int = 60  # total trials in the study (all workers together, earlier runs included)
    objective: str = "predicted"
    dataset: str = "code,text"  # comma-separated prompt sets (see selfspec.tools.datasets)
    num_samples: int = 4  # prompts per set
    max_new_tokens: int = 64  # greedy continuation scored per prompt
    draft_vocabs: tuple[int, ...] = DRAFT_VOCABS  # besides the full vocabulary
    thresholds: bool = True  # also search confidence-threshold drafting
    adapter: str | None = None  # an exit adapter to include (strategy exit-adapter)
    storage: str | None = None  # Optuna storage URL; default: sqlite in the output directory
    study_name: str | None = None  # default: selfspec-<model fingerprint>
    workers: int = 1
    seed: int = 0
    confirm: bool = True  # measure the winner against plain decoding

    def __post_init__(self):
        if isinstance(self.strategies, str):
            object.__setattr__(self, "strategies", tuple(s.strip() for s in self.strategies.split(",") if s.strip()))
        if isinstance(self.draft_vocabs, str):
            try:
                vs = tuple(int(v) for v in self.draft_vocabs.split(",") if v.strip() and v.strip() != "full")
            except ValueError as e:
                raise SelfSpecError(f"--draft-vocabs must be a comma-separated list of sizes, got {self.draft_vocabs!r}") from e
            object.__setattr__(self, "draft_vocabs", vs)
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad or not self.strategies:
            raise SelfSpecError(f"search strategies must be among {', '.join(STRATEGIES)}, got {', '.join(bad) or 'none'}")
        if "exit-adapter" in self.strategies and not self.adapter:
            raise SelfSpecError("searching exit-adapter needs --adapter FILE")
        if not isinstance(self.n_trials, int) or self.n_trials < 1:
            raise SelfSpecError(f"the search budget must be at least 1 trial, got {self.n_trials}")
        if self.objective not in OBJECTIVES:
            raise SelfSpecError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.num_samples < 1 or self.max_new_tokens < 2:
            raise SelfSpecError("the calibration set needs at least 1 prompt and 2 new tokens per prompt")
        if self.workers < 1:
            raise SelfSpecError(f"--workers must be >= 1, got {self.workers}")
        if any(v < 1 for v in self.draft_vocabs):
            raise SelfSpecError("draft vocabulary sizes must be positive")


# ---- calibration: prompts, their greedy continuations, and teacher-forced signals ---------------


@dataclass
class Sequence:
    prompt: str
    ids: list[int]  # prompt + greedy continuation
    start: int  # len(prompt ids): ids[start:] is the model's own continuation


class Calibration:
    """Greedy continuations of the calibration prompts and the signals trials read, computed
    lazily and memoised (an exit layer's hidden states serve every K / threshold / vocab)."""

    def __init__(self, model, prompts: list[str], max_new_tokens: int):
        if not prompts:
            raise SelfSpecError("the calibration set is empty")
        self.model = model
        self.seqs: list[Sequence] = []
        for p in prompts:
            ids = model.encode(p)
            out = model.generate(ids, max_new_tokens=max_new_tokens)
            self.seqs.append(Sequence(p, ids + out.token_ids, len(ids)))
        self._signals: dict = {}
        self._heads: dict = {}

    def head(self, draft_vocab: int | None):
        if draft_vocab is None:
            return None, None
        if draft_vocab not in self._heads:
            rt = self.model.runtime
            vocab = self.model.draft_vocabulary(draft_vocab)
            self._heads[draft_vocab] = (rt.prepare_weight(rt.head_columns(vocab).contiguous()), vocab)
        return self._heads[draft_vocab]

    def signals(self, kind: tuple, draft_vocab: int | None, adapter=None) -> list:
        """Per sequence, the Calibration of drafts `kind` (("exit", E) | ("skip", a, m) |
        ("adapter", E)) over the continuation positions (the last prompt token onward)."""
        key = (kind, draft_vocab)
        if key not in self._signals:
            head, vocab = self.head(draft_vocab)
            out = []
            for s in self.seqs:
                kw: dict = {}
                if kind[0] == "exit":
                    kw["exits"] = [kind[1]]
                elif kind[0] == "skip":
                    kw["skip_sets"] = [(kind[1], kind[2])]
                else:
                    kw["adapters"] = {kind[1]: adapter}
                # Scored positions: ids[start] (the prefill's token, pending at the first
                # step) onward; the last token is left out, its successor is unknown.
                sig = teacher_forced(self.model.runtime, s.ids[:-1], s.start, draft_head=head, vocab=vocab, **kw)
                out.append(sig[kind])
            if len(self._signals) > 256:  # skip sets are rarely revisited: bound the memo
                self._signals.clear()
            self._signals[key] = out
        return self._signals[key]


def predict(cfg: DraftConfig, cal: Calibration, costs: CostModel, adapter=None, adapter_cost: float = 0.0) -> Prediction:
    """Predicted totals of cfg over the calibration sequences."""
    total = Prediction()
    if cfg.strategy == "prompt-lookup":
        for s in cal.seqs:
            # The engine's first step has the first generated token pending.
            total = total.add(simulate_lookup(cfg, s.ids, s.start, costs))
        return total
    if cfg.strategy == "early-exit":
        kind = ("exit", cfg.exit_layer)
    elif cfg.strategy == "exit-adapter":
        kind = ("adapter", cfg.exit_layer)
    else:
        kind = ("skip", cfg.skip_attn, cfg.skip_mlp)
    for s, sig in zip(cal.seqs, cal.signals(kind, cfg.draft_vocab, adapter)):
        total = total.add(simulate(cfg, sig, costs, adapter_cost, tokens=s.ids, start=s.start))
    return total


def measure(model, cfg: DraftConfig, prompts: list[str], max_new_tokens: int, repeats: int = 1) -> dict:
    """Plain decoding and cfg on each prompt, interleaved; -> speedup of summed times and
    whether every output matched."""
    base_cfg = DraftConfig("autoregressive")
    t_ar = t_sp = 0.0
    same = True
    tokens = 0
    acc = drafted = 0
    for _ in range(repeats):
        for p in prompts:
            a = model.generate(p, max_new_tokens=max_new_tokens, draft=base_cfg)
            b = model.generate(p, max_new_tokens=max_new_tokens, draft=cfg)
            t_ar += a.stats.time_s
            t_sp += b.stats.time_s
            tokens += b.stats.new_tokens
            same &= a.token_ids == b.token_ids
            acc += b.stats.accepted
            drafted += b.stats.drafted
    return {
        "measured_speedup": t_ar / t_sp if t_sp > 0 else 0.0,
        "ar_tokens_per_second": tokens / t_ar if t_ar else 0.0,
        "tokens_per_second": tokens / t_sp if t_sp else 0.0,
        "measured_acceptance_rate": acc / drafted if drafted else 0.0,
        "identical_to_autoregressive": bool(same),
    }


# ---- the Optuna side -----------------------------------------------------------------------------


def _optuna():
    try:
        import optuna
    except ImportError as e:  # a dependency, but say so clearly if it is missing
        raise SelfSpecError("selfspec search needs optuna: pip install optuna") from e
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def open_study(cfg: SearchConfig, storage: str, study_name: str, worker: int = 0):
    import warnings

    optuna = _optuna()
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # multivariate/group TPE
    try:
        return optuna.create_study(
            storage=storage, study_name=study_name, load_if_exists=True, direction="maximize",
            sampler=optuna.samplers.TPESampler(seed=cfg.seed + 1000 * worker, multivariate=True, group=True),
        )
    except Exception as e:  # bad URL, unreachable server, missing driver, unwritable file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SelfSpecError(f"cannot open the study storage {storage}: {first}") from e


def suggest(trial, cfg: SearchConfig, num_layers: int, vocab_size: int, adapter_exit: int | None) -> DraftConfig:
    """The trial's draft configuration (see the module doc for the space)."""
    strategy = trial.suggest_categorical("strategy", list(cfg.strategies))
    if strategy == "prompt-lookup":
        return DraftConfig("prompt-lookup", num_speculations=trial.suggest_int("lookup_k", 1, MAX_K),
                           max_ngram=trial.suggest_int("max_ngram", 1, 4))
    vocabs = ["full"] + [str(v) for v in cfg.draft_vocabs if v < vocab_size]
    vocab = trial.suggest_categorical("draft_vocab", vocabs)
    draft_vocab = None if vocab == "full" else int(vocab)
    threshold = None
    if cfg.thresholds and trial.suggest_categorical("draft_length", ["fixed", "threshold"]) == "threshold":
        K, threshold = MAX_K, trial.suggest_float("draft_threshold", 0.05, 0.95)
    else:
        K = trial.suggest_int("num_speculations", 1, MAX_K)
    lookup_first = trial.suggest_categorical("lookup_first", [False, True])
    common = dict(num_speculations=K, draft_threshold=threshold, draft_vocab=draft_vocab, lookup_first=lookup_first)
    if strategy == "early-exit":
        return DraftConfig("early-exit", exit_layer=trial.suggest_int("exit_layer", 1, num_layers - 1), **common)
    if strategy == "exit-adapter":
        return DraftConfig("exit-adapter", exit_layer=adapter_exit, adapter=cfg.adapter, **common)
    # How many sub-layers to skip, then which: the n with the highest per-layer priority. Independent
    # yes/no per sub-layer would draw half of them skipped, where drafts are useless.
    attn = _top_n(trial, "attn", num_layers, trial.suggest_int("skip_attn_n", 0, num_layers // 2))
    mlp = _top_n(trial, "mlp", num_layers, trial.suggest_int("skip_mlp_n", 0, num_layers // 2))
    if not attn and not mlp:
        return DraftConfig("autoregressive")  # skipping nothing: the draft is the model itself (scored as plain decoding)
    if len(attn) == num_layers and len(mlp) == num_layers:
        raise ValueError("skips everything")
    return DraftConfig("layer-skip", skip_attn=attn, skip_mlp=mlp, **common)


def _top_n(trial, kind: str, num_layers: int, n: int) -> tuple[int, ...]:
    w = [trial.suggest_float(f"{kind}_priority_{i}", 0.0, 1.0) for i in range(num_layers)]
    return tuple(sorted(sorted(range(num_layers), key=lambda i: -w[i])[:n]))


@dataclass
class SearchResult:
    best: DraftConfig
    metrics: dict
    trials: list[dict] = field(default_factory=list)
    interrupted: bool = False


def run_worker(model, cfg: SearchConfig, storage: str, study_name: str, cal: Calibration, costs: CostModel,
               log=print, worker: int = 0, wait_for: int = 1, start: float = 0.0, wait_timeout: float = 600.0,
               alive=lambda: True):
    """Run trials on the shared study until it holds cfg.n_trials finished ones (after
    waiting for `wait_for` workers that announced themselves since `start`)."""
    optuna = _optuna()
    study = open_study(cfg, storage, study_name, worker)
    L, V = model.spec.num_layers, model.spec.vocab_size
    adapter, adapter_cost, adapter_exit = None, 0.0, None
    if cfg.adapter:
        adapter, _ = model.resources.adapter(cfg.adapter)
        adapter_exit = adapter.meta.exit_layer
        adapter_cost = _time_adapter(adapter, model)
    prompts = [s.prompt for s in cal.seqs]

    def objective(trial) -> float:
        try:
            d = suggest(trial, cfg, L, V, adapter_exit)
        except ValueError:
            return 0.0
        trial.set_user_attr("draft", d.to_dict())
        trial.set_user_attr("worker", worker)
        if not d.speculative:
            trial.set_user_attr("predicted_speedup", 1.0)
            return 1.0 if cfg.objective == "predicted" else 1.0
        pred = predict(d, cal, costs, adapter, adapter_cost)
        c = costs.draft_token(d, adapter_cost) / costs.ar_step
        trial.set_user_attr("predicted_speedup", pred.speedup)
        trial.set_user_attr("acceptance_rate", pred.acceptance_rate)
        trial.set_user_attr("mean_accepted_length", pred.mean_accepted_length)
        trial.set_user_attr("c", c)
        if cfg.objective == "measured":
            m = measure(model, d, prompts, cfg.max_new_tokens)
            for k, v in m.items():
                trial.set_user_attr(k, v)
            value = m["measured_speedup"]
        else:
            value = pred.speedup
        log(f"trial {trial.number}: {d.label()}  speedup {value:.3f}  acceptance {pred.acceptance_rate:.0%}  c {c:.2f}")
        return value

    # A start line: workers spend their first seconds loading and calibrating; the one that
    # started them waits (bounded) until all are ready, so the trials are shared.
    study.set_user_attr(f"ready_{worker}_{os.getpid()}", time.time())
    deadline = time.time() + wait_timeout
    while wait_for > 1 and time.time() < deadline and alive():  # alive(): no worker died
        if sum(k.startswith("ready_") and v >= start for k, v in study.user_attrs.items()) >= wait_for:
            break
        time.sleep(0.2)
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    remaining = cfg.n_trials - len(study.get_trials(deepcopy=False, states=done))
    if remaining > 0:
        study.optimize(objective, callbacks=[optuna.study.MaxTrialsCallback(cfg.n_trials, states=done)],
                       catch=(SelfSpecError,))
    return study


def _time_adapter(adapter, model, repeats: int = 20) -> float:
    h = torch.zeros(1, model.spec.hidden_size, dtype=model.runtime.dtype, device=model.runtime.device)
    with torch.inference_mode():
        adapter(h)
        t0 = time.perf_counter()
        for _ in range(repeats):
            adapter(h)
    return (time.perf_counter() - t0) / repeats


def trial_rows(study) -> list[dict]:
    optuna = _optuna()
    rows = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        rows.append({"number": t.number, "value": t.value, **t.user_attrs})
    return rows


def best_of(study) -> tuple[DraftConfig, dict]:
    rows = [r for r in trial_rows(study) if r.get("draft") and r["draft"]["strategy"] != "autoregressive"]
    if not rows:
        raise SelfSpecError("the study has no finished trials yet")
    best = max(rows, key=lambda r: r["value"])
    return DraftConfig.from_dict(best["draft"]), {k: v for k, v in best.items() if k not in ("draft",)}


def plot_history(study, path: str | os.PathLike, title: str = "", objective: str = "predicted",
                 confirmed: dict | None = None) -> None:
    """Optimisation history: every trial's objective (labelled as predicted or measured) and
    the best so far; with `confirmed` (the winner's metrics after measurement) the winner's
    measured speedup beside its trial's value, so a prediction that did not hold shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from selfspec.profiles import atomic_write_bytes

    rows = sorted(trial_rows(study), key=lambda r: r["number"])
    if not rows:
        return
    xs = [r["number"] for r in rows]
    ys = [r["value"] for r in rows]
    what = "predicted" if objective == "predicted" else "measured"
    colors = {"early-exit": "tab:blue", "layer-skip": "tab:orange", "prompt-lookup": "tab:green", "exit-adapter": "tab:purple"}
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
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def calibration_prompts(cfg: SearchConfig) -> list[str]:
    from selfspec.tools.datasets import load_dataset

    prompts: list[str] = []
    for name in [n.strip() for n in cfg.dataset.split(",") if n.strip()]:
        prompts += [s.prompt for s in load_dataset(name, cfg.num_samples, cfg.seed).samples]
    if not prompts:
        raise SelfSpecError(f"the calibration set {cfg.dataset!r} has no prompts")
    return prompts


def default_storage(out_dir: str | os.PathLike) -> str:
    return f"sqlite:///{Path(out_dir).resolve() / 'study.db'}"


def summary(study) -> dict:
    rows = trial_rows(study)
    by: dict[str, dict] = {}
    for r in rows:
        s = r.get("draft", {}).get("strategy")
        if s and (s not in by or r["value"] > by[s]["value"]):
            by[s] = r
    return {s: {"value": r["value"], "label": DraftConfig.from_dict(r["draft"]).label(), "c": r.get("c"),
                "acceptance_rate": r.get("acceptance_rate"), "draft": r["draft"]} for s, r in by.items()}


def json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


__all__ = ["SearchConfig", "Calibration", "predict", "measure", "run_worker", "best_of", "plot_history", "summary",
           "calibration_prompts", "default_storage", "json_safe"]
