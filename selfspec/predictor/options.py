"""A strategy's calibrated options: what a strategy named without options takes on a model with
no profile that measured it (SelfSpecModel.draft_config; the profile comes first, the static
defaults of config.py last).

Only for a strategy that runs without a required option (quantized, prompt lookup: an early
exit needs its exit layer, layer skip its skip sets, from the user or a profile). The choice
is of the bare strategy, whatever options a call gives (they override only themselves), so
that a call and a server request naming the strategy start from the same options. The
predictor ranks a small grid (K 1..8, the full or a restricted draft vocabulary, lookup first
or not; prompt lookup: K and the n-gram) by their
predicted speedup over the model's own greedy continuations of one prompt of code and one of
prose (data/calibration_prompts.json), with the model's measured costs: the search's objective (objective.py),
exhaustively over a grid a few dozen configurations wide. The choice is kept on disk beside
the measured costs (same identity: model, numerics, threads, build), so it is made once per
model and machine (a few seconds on the default model's size).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from functools import cache
from pathlib import Path

from selfspec.config import DRAFT_BITS, DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.predictor.calibrate import AUTO_DRAFT_VOCAB
from selfspec.predictor.costs import load_stored, save_stored
from selfspec.predictor import objective

CALIBRATED = ("quantized", "prompt-lookup")  # strategies that run bare and the predictor models
PROMPTS = Path(__file__).resolve().parent.parent / "data" / "calibration_prompts.json"  # set name -> prompts (the built-in sets' first)
NEW_TOKENS = 48
MAX_PROMPT_TOKENS = 256
GRID_K = tuple(range(1, 9))
FORMAT = "selfspec-options/1"

_log = logging.getLogger("selfspec")
_lock = threading.Lock()


def candidates(strategy: str, vocab_size: int, restricted: bool) -> list[DraftConfig]:
    """The grid; restricted: whether a restricted draft vocabulary (AUTO_DRAFT_VOCAB) is worth trying."""
    if strategy == "prompt-lookup":
        axes = {"num_speculations": GRID_K, "max_ngram": (1, 2, 3, 4)}
    else:
        vocabs = (None, AUTO_DRAFT_VOCAB) if restricted and vocab_size > 2 * AUTO_DRAFT_VOCAB else (None,)
        axes = {"num_speculations": GRID_K, "draft_vocab": vocabs, "lookup_first": (False, True)}
    out = []
    for combo in itertools.product(*axes.values()):
        try:
            out.append(DraftConfig.from_dict({**dict(zip(axes, combo)), "strategy": strategy}))
        except SelfSpecError:
            continue
    return out


@cache
def calibration_prompts() -> dict[str, list[str]]:
    """The calibration prompts, by set (code, text)."""
    return json.loads(PROMPTS.read_text())


def calibrated_options(model, strategy: str) -> dict | None:
    """The options the predictor ranks best for `strategy` named bare on `model`, or None where
    it cannot rank them (a strategy with a required option or that it does not model, no
    tokenizer, a quantized copy without the CPU kernels)."""
    if strategy not in CALIBRATED or model.tokenizer is None or not model.resources.fingerprint:
        return None
    if strategy == "quantized" and not model.runtime.uses_kernels:
        return None
    key = {**model.resources._machine_identity(), "kind": "options", "strategy": strategy}
    with _lock:  # one calibration at a time (two threads asking at once: the second reads the first's)
        saved = load_stored(key, FORMAT)
        if saved is not None and isinstance(saved.get("options"), dict):
            return saved["options"]
        chosen = _rank(model, strategy)
        if chosen is not None:
            save_stored(key, FORMAT, chosen)
            return chosen["options"]
    return None


def _rank(model, strategy: str) -> dict | None:
    res, spec = model.resources, model.spec
    restricted = res.has_token_order()
    allowed = getattr(model.runtime, "draft_bits", None)  # a GGUF run natively: int4 copies only (ggml_weights.py)
    grid = [c for c in candidates(strategy, spec.vocab_size, restricted) if allowed is None or c.strategy != "quantized" or c.draft_bits in allowed]
    if not grid:
        return None
    _log.warning("selfspec: note: no profile measured %s on this model; choosing its options by calibration "
                 "(once per model and machine: kept with the measured costs)", strategy)
    room = min(MAX_PROMPT_TOKENS, (model.context_length - NEW_TOKENS) // 2)  # the prompt's last tokens, well within the context
    prompts = [model.tokenizer(text).input_ids[-room:] for texts in calibration_prompts().values() for text in texts]
    try:
        cal = objective.Calibration(model, prompts, NEW_TOKENS, strategy="autoregressive")
    except SelfSpecError as e:  # nothing to rank on: the static defaults, chosen again next time
        _log.warning("selfspec: note: %s; %s keeps its static defaults", e, strategy)
        return None
    heads = {c.draft_head() for c in grid} - {(None, None)}
    bits = {c.draft_bits for c in grid if c.strategy == "quantized"}
    costs = res.cost_model(heads=tuple(heads), bits=tuple(b for b in bits if b in DRAFT_BITS)).greedy()
    scored = [(objective.predict(c, cal, costs).speedup, c) for c in grid]
    best_speedup, best = max(scored, key=lambda sc: sc[0])
    return {"options": best.explicit_options(), "predicted_speedup": best_speedup, "label": best.label()}
