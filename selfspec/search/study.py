"""The Optuna side: a study in any storage URL (so a search resumes and any number of workers
share it), the trials' objective, and reading results back."""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.extras import require
from selfspec.predictor.costs import CostModel
from selfspec.predictor.objective import Calibration, predict
from selfspec.search.objective import measure
from selfspec.search.space import SearchConfig, seed_trials, suggest


def _optuna():
    require("selfspec search", "optuna")
    import optuna  # the search extra, slow to import: only a search needs it
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def open_study(cfg: SearchConfig, storage: str, study_name: str, worker: int = 0):
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
    if worker == 0 and not study.get_trials(deepcopy=False):
        for params in seed_trials(cfg, V):
            study.enqueue_trial(params)
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
