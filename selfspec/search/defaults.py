"""A strategy's calibrated options: what a strategy named without options takes on a model with
no profile that measured it (SelfSpecModel.draft_config; the profile comes first, the static
defaults of config.py last).

The predictor ranks a small grid of the options the user did not give (K 1..8, the full or a
restricted draft vocabulary, lookup first or not; prompt lookup: K and the n-gram) by their
predicted speedup over the model's own greedy continuations of one prompt of each built-in
set (`code`, `text`), with the model's measured costs: the search's objective (objective.py),
exhaustively over a grid a few dozen configurations wide. The choice is kept on disk beside
the measured costs (same identity: model, numerics, threads, build), so it is made once per
model and machine (a few seconds on the default model's size).
"""

from __future__ import annotations

import itertools
import logging
import threading

from selfspec.config import DRAFT_BITS, DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.predictor.calibrate import AUTO_DRAFT_VOCAB
from selfspec.predictor.costs import load_stored, save_stored

CALIBRATED = ("early-exit", "layer-skip", "quantized", "prompt-lookup")  # strategies the predictor models here
SETS = ("code", "text")
PROMPTS_PER_SET = 1
NEW_TOKENS = 48
MAX_PROMPT_TOKENS = 256
GRID_K = tuple(range(1, 9))
FORMAT = "selfspec-options/1"

_log = logging.getLogger("selfspec")
_lock = threading.Lock()


def candidates(strategy: str, given: dict, vocab_size: int, restricted: bool) -> list[DraftConfig]:
    """The grid: every combination of the options not in `given` (given ones stay fixed);
    restricted: whether a restricted draft vocabulary (AUTO_DRAFT_VOCAB) is worth trying."""
    if strategy == "prompt-lookup":
        axes = {"num_speculations": GRID_K, "max_ngram": (1, 2, 3, 4)}
    else:
        vocabs = (None, AUTO_DRAFT_VOCAB) if restricted and vocab_size > 2 * AUTO_DRAFT_VOCAB else (None,)
        axes = {"num_speculations": GRID_K, "draft_vocab": vocabs, "lookup_first": (False, True)}
    axes = {k: v for k, v in axes.items() if k not in given}
    out = []
    for combo in itertools.product(*axes.values()):
        try:
            out.append(DraftConfig.from_dict({**given, **dict(zip(axes, combo)), "strategy": strategy}))
        except SelfSpecError:
            continue
    return out


def calibrated_options(model, strategy: str, given: dict) -> dict | None:
    """The options (besides `given`) the predictor ranks best for `strategy` on `model`, or
    None where it cannot rank them (another strategy, one missing a required option, no
    tokenizer, a quantized copy without the CPU kernels)."""
    if strategy not in CALIBRATED or model.tokenizer is None or not model.resources.fingerprint:
        return None
    if strategy == "quantized" and not model.runtime.uses_kernels:
        return None
    try:
        DraftConfig.from_dict({**given, "strategy": strategy})  # a required option missing: not ours to choose
    except SelfSpecError:
        return None
    key = {**model.resources._machine_identity(), "kind": "options", "strategy": strategy,
           "given": DraftConfig.from_dict({**given, "strategy": strategy}).to_dict()}
    with _lock:  # one calibration at a time (two threads asking at once: the second reads the first's)
        saved = load_stored(key, FORMAT)
        if saved is not None and isinstance(saved.get("options"), dict):
            return saved["options"]
        chosen = _rank(model, strategy, given)
        if chosen is not None:
            save_stored(key, FORMAT, chosen)
            return chosen["options"]
    return None


def _rank(model, strategy: str, given: dict) -> dict | None:
    from selfspec.search.objective import Calibration, predict  # imported late: the search package needs optuna only to search
    from selfspec.tools.datasets import load_dataset

    res, spec = model.resources, model.spec
    restricted = res.has_token_order()
    grid = candidates(strategy, given, spec.vocab_size, restricted)
    if not grid:
        return None
    _log.warning("selfspec: note: no profile measured %s on this model; choosing its options by calibration "
                 "(once per model and machine: kept with the measured costs)", strategy)
    room = min(MAX_PROMPT_TOKENS, (model.context_length - NEW_TOKENS) // 2)  # the prompt's last tokens, well within the context
    prompts = [model.tokenizer(s.prompt).input_ids[-room:] for name in SETS for s in load_dataset(name, PROMPTS_PER_SET, seed=0).samples]
    cal = Calibration(model, prompts, NEW_TOKENS, strategy="autoregressive")
    heads = {c.draft_head() for c in grid} - {(None, None)}
    bits = {c.draft_bits for c in grid if c.strategy == "quantized"}
    costs = res.cost_model(heads=tuple(heads), bits=tuple(b for b in bits if b in DRAFT_BITS)).greedy()
    scored = [(predict(c, cal, costs).speedup, c) for c in grid]
    best_speedup, best = max(scored, key=lambda sc: sc[0])
    options = {k: v for k, v in best.explicit_options().items() if k not in given}
    return {"options": options, "predicted_speedup": best_speedup, "label": best.label()}
