"""`selfspec search`: find the best draft configuration for a model (see selfspec/search)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from selfspec import search as S
from selfspec.cli_args import add_config_args, add_model_args, config_kwargs, load_model
from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.profiles import Profile, atomic_write_text, install_profile, save_profile
from selfspec.search import SearchConfig
from selfspec.tools.cli import _loud

INTERRUPTED = 130
_AUTO_FLAGS = ("thresholds", "confirm", "workers", "storage")  # flags written by hand below


def register(sub) -> None:
    p = sub.add_parser("search", help="Bayesian search (Optuna) of exit layer / skip sets / K / draft vocabulary; writes a profile",
                       description="Searches draft configurations by predicted speedup (or measured tokens/s), confirms the "
                                   "winner by measurement and writes a draft profile plus an optimisation-history plot.")
    add_model_args(p)
    add_config_args(p, SearchConfig, skip=_AUTO_FLAGS, helps={
        "strategies": "comma list of early-exit, layer-skip, prompt-lookup, quantized, exit-adapter",
        "n_trials": "total finished trials the study should hold (all workers, earlier runs included)",
        "objective": "predicted (replayed greedy decoding + measured costs) or measured (timed generations)",
        "dataset": "comma list of prompt sets for calibration: code, text, summarize, a .jsonl, hf:...",
        "num_samples": "prompts per set",
        "max_new_tokens": "greedy continuation scored per prompt",
        "draft_vocabs": "restricted draft vocabulary sizes to try besides the full vocabulary (comma list)",
        "adapter": "an exit adapter to include in the search (strategy exit-adapter)",
        "study_name": "Optuna study name (default: selfspec-<model fingerprint>)",
        "seed": "seed of the TPE sampler and of the prompt selection",
    })
    p.add_argument("--storage", default=None, help="Optuna storage URL, e.g. sqlite:///study.db (default: OUT_DIR/study.db); "
                                                   "several processes or machines may share one study")
    p.add_argument("--workers", type=int, default=1, help="local worker processes on the same study (default: 1)")
    p.add_argument("--no-thresholds", action="store_true", help="search fixed draft lengths only")
    p.add_argument("--no-confirm", action="store_true", help="skip measuring the winner (and each strategy's best, written to the profile's strategies map) against plain decoding")
    p.add_argument("--out-dir", default="search-results", help="profile.json, history.png, search.json (default: search-results)")
    p.add_argument("--install", action="store_true", help="also install the profile for this model: --strategy auto uses it")
    p.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker-only", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_search)


def _config(args):
    kw = config_kwargs(args, SearchConfig)
    kw.update(thresholds=not args.no_thresholds, confirm=not args.no_confirm, workers=args.workers, storage=args.storage)
    return SearchConfig(**kw)


def _writable_dir(path: str) -> Path:
    d = Path(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / ".selfspec-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SelfSpecError(f"cannot write to the output directory {d}: {e.strerror or e}") from e
    return d


def _worker_command(args, cfg, storage: str, study_name: str, index: int) -> list[str]:
    cmd = [sys.executable, "-m", "selfspec", "search", "--model", args.model, "--storage", storage,
           "--study-name", study_name, "--worker-index", str(index), "--worker-only", "--no-confirm",
           "--out-dir", args.out_dir, "--strategies", ",".join(cfg.strategies), "--n-trials", str(cfg.n_trials),
           "--objective", cfg.objective, "--dataset", cfg.dataset, "--num-samples", str(cfg.num_samples),
           "--max-new-tokens", str(cfg.max_new_tokens), "--draft-vocabs", ",".join(map(str, cfg.draft_vocabs)) or "full",
           "--seed", str(cfg.seed)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.device:
        cmd += ["--device", args.device]
    if args.allow_pickle:
        cmd += ["--allow-pickle"]
    if cfg.adapter:
        cmd += ["--adapter", cfg.adapter]
    if not cfg.thresholds:
        cmd.append("--no-thresholds")
    return cmd


def cmd_search(args) -> int:
    cfg = _config(args)
    out_dir = _writable_dir(args.out_dir)
    storage = cfg.storage or S.default_storage(out_dir)
    S.open_study(cfg, storage, cfg.study_name or "selfspec-probe")  # an unreachable storage fails before the model loads
    prompts = S.calibration_prompts(cfg)
    model = load_model(args)
    cfg = _searchable(cfg, model)
    study_name = cfg.study_name or f"selfspec-{model.fingerprint}"
    console = Console(stderr=True)
    log = (lambda msg: console.print(f"[dim][worker {args.worker_index}][/dim] {msg}", highlight=False))
    log(f"calibrating: greedy continuations of {len(prompts)} prompts, primitive costs")
    cal = S.Calibration(model, prompts, cfg.max_new_tokens)
    costs = model.resources.cost_model(*S.cost_parts(cfg, model.spec.vocab_size)).greedy()  # it scores greedy decoding
    study, interrupted = _run_workers(args, cfg, model, storage, study_name, cal, costs, log)
    if args.worker_only:
        return INTERRUPTED if interrupted else 0
    best, metrics = S.best_of(study)
    if cfg.confirm and not interrupted:
        log(f"confirming the winner by measurement: {best.label()}")
        metrics.update(S.measure(model, best, prompts, cfg.max_new_tokens))
        if not metrics["identical_to_autoregressive"]:
            raise SelfSpecError("the winner's output differs from plain decoding: please report this bug")
    metrics.update(costs=costs.to_dict(), storage=storage, study_name=study_name, n_trials=len(S.trial_rows(study)),
                   calibration={"dataset": cfg.dataset, "num_samples": cfg.num_samples, "max_new_tokens": cfg.max_new_tokens})
    # The measurement decides when there is one; else the prediction. auto and install read the mark.
    speed = metrics.get("measured_speedup", metrics.get("predicted_speedup", metrics.get("value")))
    if "measured_speedup" in metrics:
        metrics["speedup_vs_autoregressive"] = metrics["measured_speedup"]
    metrics["slower_than_autoregressive"] = speed is not None and speed < 1.0
    strategies = _best_per_strategy(cfg, model, study, best, metrics, prompts, log, confirm=cfg.confirm and not interrupted)
    profile = Profile(best, model.fingerprint, model.name, S.json_safe(metrics), strategies=S.json_safe(strategies))
    _write_results(args, cfg, model, study, profile, out_dir, interrupted, speed)
    if args.install:
        log(f"installed for --strategy auto: {install_profile(profile)}")  # refuses a losing profile (exit 2)
    return INTERRUPTED if interrupted else 0


CONFIRM_PER_STRATEGY = 3  # a strategy's best predicted trials measured for its entry in the strategies map


def _best_per_strategy(cfg: SearchConfig, model, study, best: DraftConfig, metrics: dict, prompts: list[str], log,
                       confirm: bool) -> dict:
    """The profile's `strategies` map: for each searched strategy the options it takes when
    named without any (SelfSpecModel.draft_config). Confirming, its CONFIRM_PER_STRATEGY best
    predicted trials are measured against plain decoding and the fastest measured is kept (a
    prediction's costs were timed once, on a machine whose speed drifts); else its best
    predicted trial. The winner's own measurement is reused."""
    ranked: dict[str, list[tuple[float, DraftConfig, dict]]] = {}
    for row in sorted(S.trial_rows(study), key=lambda r: -(r.get("value") or 0.0)):
        d = row.get("draft")
        if not d or d.get("strategy") in (None, "autoregressive", "auto") or row.get("value") is None:
            continue
        draft = DraftConfig.from_dict(d)
        mine = ranked.setdefault(draft.strategy, [])
        if draft not in [c for _, c, _ in mine] and len(mine) < (CONFIRM_PER_STRATEGY if confirm else 1):
            mine.append((row["value"], draft, row))
    out = {}
    for strategy, cands in sorted(ranked.items()):
        entries = []
        for value, draft, row in cands:
            m = {"source": "selfspec search", "predicted_speedup": value, "acceptance_rate": row.get("acceptance_rate"),
                 "c": row.get("c"), "label": draft.label()}
            if confirm:
                if draft == best and "measured_speedup" in metrics:
                    measured = {k: metrics[k] for k in ("measured_speedup", "measured_acceptance_rate", "identical_to_autoregressive")
                                if k in metrics}
                else:
                    log(f"measuring {strategy}: {draft.label()}")
                    measured = S.measure(model, draft, prompts, cfg.max_new_tokens)
                    if not measured["identical_to_autoregressive"]:
                        raise SelfSpecError(f"{draft.label()}'s output differs from plain decoding: please report this bug")
                m.update(measured, candidates_measured=len(cands))
            entries.append((draft, m))
        draft, m = max(entries, key=lambda e: e[1].get("measured_speedup", e[1]["predicted_speedup"]))
        out[strategy] = {"options": draft.explicit_options(), "metrics": m}
    return out


def _searchable(cfg: SearchConfig, model) -> SearchConfig:
    """cfg without the quantized family where the kernels cannot run it."""
    if "quantized" not in cfg.strategies or model.runtime.uses_kernels:
        return cfg
    if cfg.strategies == ("quantized",):
        raise SelfSpecError("quantized drafting needs selfspec's CPU kernels (an x86-64 CPU with AVX2 or AVX-512, and a C compiler)")
    print("selfspec: quantized drafting needs selfspec's CPU kernels; searching the other strategies", file=sys.stderr)
    return dataclasses.replace(cfg, strategies=tuple(s for s in cfg.strategies if s != "quantized"))


def _run_workers(args, cfg, model, storage, study_name, cal, costs, log):
    """This process's trials, with cfg.workers - 1 more processes on the same study; -> (study,
    interrupted)."""
    start = time.time()
    workers: list[subprocess.Popen] = []
    if cfg.workers > 1 and not args.worker_only:
        for i in range(1, cfg.workers):
            workers.append(subprocess.Popen(_worker_command(args, cfg, storage, study_name, i)))
        log(f"started {len(workers)} more worker process(es) on {storage}")
    interrupted = False
    try:
        study = S.run_worker(model, cfg, storage, study_name, cal, costs, log=log, worker=args.worker_index,
                             wait_for=len(workers) + 1, start=start,
                             alive=lambda: all(w.poll() is None for w in workers))
    except KeyboardInterrupt:
        interrupted = True
        study = S.open_study(cfg, storage, study_name, args.worker_index)
    finally:
        for w in workers:
            if interrupted:
                w.terminate()
            w.wait()
    bad = [w.returncode for w in workers if w.returncode not in (0, None) and not interrupted]
    if bad:
        raise SelfSpecError(f"a worker process failed (exit status {bad[0]}); finished trials are kept in {storage}")
    return study, interrupted


def _write_results(args, cfg, model, study, profile, out_dir: Path, interrupted: bool, speed) -> None:
    """profile.json, history.png, search.json; the best per strategy and the verdict printed."""
    best, metrics = profile.draft, profile.metrics
    save_profile(profile, out_dir / "profile.json")
    S.plot_history(study, out_dir / "history.png", f"draft search: {model.name or args.model}", cfg.objective,
                   metrics if "measured_speedup" in metrics else None)
    summary = S.json_safe({"best": best.to_dict(), "metrics": metrics, "best_per_strategy": S.summary(study),
                           "trials": S.trial_rows(study), "interrupted": interrupted})
    atomic_write_text(out_dir / "search.json", json.dumps(summary, indent=2) + "\n")
    t = Table(title=f"best per strategy ({metrics['n_trials']} trials, objective {cfg.objective})")
    for col in ("strategy", "configuration", "speedup", "acceptance", "c"):
        t.add_column(col)
    for strat, r in sorted(summary["best_per_strategy"].items(), key=lambda kv: -kv[1]["value"]):
        t.add_row(strat, r["label"], f"{r['value']:.3f}", f"{(r['acceptance_rate'] or 0):.0%}", f"{(r['c'] or 0):.2f}")
    Console().print(t)
    if "measured_speedup" in metrics:
        print(f"winner {best.label()}: predicted {metrics.get('predicted_speedup', 0):.3f}x, measured "
              f"{metrics['measured_speedup']:.3f}x, identical output: {metrics['identical_to_autoregressive']}")
    print(f"wrote {out_dir / 'profile.json'}, {out_dir / 'history.png'}, {out_dir / 'search.json'}", file=sys.stderr)
    if metrics["slower_than_autoregressive"]:
        how = "measured" if "measured_speedup" in metrics else "predicted"
        _loud(f"WARNING: the best setting found is SLOWER than autoregressive decoding ({how} {speed:.2f}x): no draft "
              "configuration searched pays off on this model and machine. profile.json is marked as losing: "
              "--strategy auto and --install will not adopt it.")
