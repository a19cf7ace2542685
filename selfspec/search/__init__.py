"""Draft search: Bayesian optimisation (Optuna TPE) of how a model drafts for itself.

    selfspec search --model M --n-trials 80 --out-dir search/ [--storage sqlite:///study.db] [--workers 2]

Search space (define-by-run, so each strategy only samples its own parameters):
  strategy       early-exit | layer-skip | prompt-lookup | quantized | exit-adapter (with --adapter)
  exit_layer     early-exit: 1..L-1 (exit-adapter: the adapter's)
  skip sets      layer-skip: how many attention / MLP sub-layers to skip, and which (the
                 n with the highest per-layer priorities; Draft & Verify's space)
  K or gamma     a fixed draft length 1..8, or a confidence threshold with K = 8
  draft_vocab    8k / 16k / 32k most frequent tokens, or the full vocabulary
  quantized      bits of the model's own weights the draft uses (8 | 4) and of its head, its
                 depth (all layers or the first E) and a few skipped sub-layers
  lookup_first   self-drafting strategies: take a prompt-lookup match first when there is one

Objective (the speed, never acceptance alone: skipping nothing accepts everything and is
slower than plain decoding):
  predicted (default)  predictor.simulate over teacher-forced greedy continuations of the
                       calibration prompts, with primitive costs measured once: a trial is
                       one cheap pass, and free of timing noise;
  measured             real generations of the calibration prompts, tokens/s over plain
                       decoding's (Draft & Verify's objective).
The winner is confirmed by measurement (plain vs drafted, interleaved, outputs compared)
and written as a draft profile for generate / bench / serve --profile.

Studies live in any Optuna storage URL, so a search resumes where it stopped and any
number of processes or machines can work on one study; `--workers N` starts N local
processes on the same storage.

Modules: space (what a trial chooses), objective (predicted / measured speedup), study
(Optuna), plots.
"""

from __future__ import annotations

from selfspec.predictor.objective import Calibration, Sequence, predict
from selfspec.search.objective import measure
from selfspec.search.plots import plot_history
from selfspec.search.space import (DRAFT_VOCABS, MAX_K, OBJECTIVES, STRATEGIES, SearchConfig, calibration_prompts,
                                   cost_parts, seed_trials, suggest)
from selfspec.search.study import (SearchResult, _optuna, best_of, default_storage, json_safe, open_study, run_worker,
                                   summary, trial_rows)

__all__ = ["SearchConfig", "Calibration", "predict", "measure", "run_worker", "best_of", "plot_history", "summary",
           "calibration_prompts", "default_storage", "json_safe", "open_study", "trial_rows", "suggest", "STRATEGIES"]
