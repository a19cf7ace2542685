"""Measured acceptance: how often a draft agrees with the target, from teacher-forced passes.

`teacher_forced` scores exits, skip sets and adapters over a whole sequence in one pass of the
full model (search's calibration); `calibrate` is auto's per-prompt choice when a model has no
profile: it scores early exits from the hidden states its prefill kept (`prefill_capturing`)
and prompt lookup on the prompt itself, and predicts each configuration's speedup (simulate).
"""

from __future__ import annotations

import torch

from selfspec.config import DraftConfig
from selfspec.predictor.costs import CostModel
from selfspec.predictor.simulate import Agreement, Prediction, simulate, simulate_lookup


def _argmax_conf(runtime, h: torch.Tensor, head=None, vocab: torch.Tensor | None = None, chunk: int = 32):
    """Greedy token and its probability for each row of h [T, H], `chunk` rows at a time
    (full-vocabulary logits of a long sequence would not fit comfortably)."""
    toks, confs = [], []
    for i in range(0, h.shape[0], chunk):
        logits = runtime.logits(h[i : i + chunk], head=head)
        conf, idx = logits.softmax(-1).max(-1)
        toks.append(idx if vocab is None else vocab[idx])
        confs.append(conf)
    return torch.cat(toks).cpu().numpy(), torch.cat(confs).float().cpu().numpy()


DRAFT_RUN = 4  # positions a quantized draft scores on its own keys/values (a typical K)


def teacher_forced(runtime, ids: list[int], score_from: int = 0, exits=(), skip_sets=(), draft_head=None,
                   vocab: torch.Tensor | None = None, adapters: dict | None = None, drafts: dict | None = None) -> dict:
    """One full forward over ids, scoring positions score_from.. against the full model's
    greedy token. Returns {"target": [T'], ("exit", E): Agreement, ("skip", a, m): ...,
    ("adapter", E): ..., key: ... for each of `drafts`}.

    Exits reuse the full pass's hidden states (layers < E are the same computation). Skip
    sets run their own teacher-forced pass, which sees draft-computed KV for earlier
    positions where the real run sees the full model's: a slight underestimate, confirmed
    later by measurement. `drafts` ({key: (draft runtime, exit layer, skip_attn, skip_mlp)},
    the quantized copy, which shares the cache layout) are scored as the engine drafts: in
    runs of DRAFT_RUN positions over the full model's cache, each run attending to the full
    model's keys/values before it and to its own within it (rows put back after). Their own
    KV over the whole continuation compounds the copy's small errors far beyond what a
    K-token draft sees (a random tiny model: 0.51 predicted vs 0.86 measured)."""
    out: dict = {}
    L = runtime.num_layers
    with torch.inference_mode():
        x = torch.tensor(ids, device=runtime.device)
        cache = full_cache = runtime.new_cache(len(ids))
        states = dict.fromkeys(set(exits) | set((adapters or {}).keys()))
        h = runtime.run_layers(runtime.embed(x), 0, L, 0, cache, capture=states)
        hidden = {i: s[score_from:] for i, s in states.items()}
        target, _ = _argmax_conf(runtime, h[score_from:])
        out["target"] = target
        for E in exits:
            tok, conf = _argmax_conf(runtime, hidden[E], draft_head, vocab)
            out[("exit", E)] = Agreement(tok == target, conf)
        for E, adapter in (adapters or {}).items():
            tok, conf = _argmax_conf(runtime, adapter(hidden[E]), draft_head, vocab)
            out[("adapter", E)] = Agreement(tok == target, conf)
        for skip_a, skip_m in skip_sets:
            cache = runtime.new_cache(len(ids))
            hs = runtime.run_layers(runtime.embed(x), 0, L, 0, cache, frozenset(skip_a), frozenset(skip_m))
            tok, conf = _argmax_conf(runtime, hs[score_from:], draft_head, vocab)
            out[("skip", tuple(skip_a), tuple(skip_m))] = Agreement(tok == target, conf)
        for key, (draft_rt, E, skip_a, skip_m) in (drafts or {}).items():
            runs = []
            for a in range(score_from, len(ids), DRAFT_RUN):
                b = min(len(ids), a + DRAFT_RUN)
                saved = full_cache.save_rows(a, b)
                try:
                    runs.append(draft_rt.run_layers(draft_rt.embed(x[a:b]), 0, E, a, full_cache, frozenset(skip_a), frozenset(skip_m)))
                finally:
                    full_cache.restore_rows(a, saved)
            tok, conf = _argmax_conf(runtime, torch.cat(runs), draft_head, vocab)
            out[key] = Agreement(tok == target, conf)
    return out


CALIBRATION_POSITIONS = 32  # last prompt positions scored by auto's calibration
CALIBRATION_EXITS = 8  # exit layers scored (evenly spaced)
CALIBRATION_MAX_K = 8
CALIBRATION_PROXY_TOP = 64  # full-vocabulary drafts are scored over the full model's top-64 per position
AUTO_DRAFT_VOCAB = 16384  # auto's draft vocabulary on models with more than 2x this many tokens
AUTO_DRAFT_BITS = 8  # the quantized copy auto's calibration scores (int8: ~98% agreement, half the bytes)


def calibration_exits(num_layers: int) -> tuple[int, ...]:
    n = min(CALIBRATION_EXITS, num_layers - 1)
    return tuple(sorted({round(1 + i * (num_layers - 2) / max(n - 1, 1)) for i in range(n)}))


def prefill_capturing(runtime, ids: torch.Tensor, cache, exits, argmax_only: bool = False) -> tuple[torch.Tensor | int, dict]:
    """The prompt's prefill (Runtime.forward's computation: the same cache and logits), keeping
    the last CALIBRATION_POSITIONS hidden states at the input of each exit layer and after the
    last layer. -> (logits [V], or the argmax token with argmax_only; captured)."""
    P = CALIBRATION_POSITIONS
    states = dict.fromkeys(exits)
    h = runtime.run_layers(runtime.embed(ids), 0, runtime.num_layers, 0, cache, capture=states)
    captured = {i: s[-P:] for i, s in states.items()}
    captured["final"] = h[-P:]
    return (runtime.argmax if argmax_only else runtime.logits)(h[-1:])[0], captured


def quantized_agreement(runtime, quant, ids: list[int], cache, target, head, vocab) -> Agreement:
    """How often the quantized copy `quant` (Runtime.quantized) agrees with the model on the
    last len(target) prompt positions, after the prefill: it attends to the model's own
    keys/values for earlier positions (as when it drafts) and its rows are put back after.
    target: the model's greedy tokens there (numpy)."""
    n, P = len(ids), len(target)
    saved = cache.save_rows(n - P, n)
    try:
        h = quant.run_layers(quant.embed(torch.tensor(ids[n - P:], device=runtime.device)), 0, quant.num_layers, n - P, cache)
    finally:
        cache.restore_rows(n - P, saved)  # the verifier's exact rows: decoding goes on from them
    tok, conf = _argmax_conf(runtime, h, head, vocab)
    return Agreement(tok == target, conf)


def calibrate(runtime, ids: list[int], costs: CostModel, auto_cfg: DraftConfig, captured: dict,
              head=None, vocab: torch.Tensor | None = None, draft_vocab: int | None = None,
              quantized: tuple | None = None) -> tuple[DraftConfig, Prediction | None]:
    """auto without a profile: score early exit at the captured exits, the quantized copy
    (`quantized`: (bits, its runtime, its draft head, the prefill's cache)) and prompt lookup
    on the prompt itself; pick the configuration with the best predicted speedup, prompt
    lookup (free drafts) when self-drafting is predicted to lose. The prompt is text the
    model did not write, so this is a proxy for acceptance; the online estimate corrects it."""
    lookup = DraftConfig("prompt-lookup", num_speculations=CALIBRATION_MAX_K, max_ngram=auto_cfg.max_ngram)
    if len(ids) < 8:
        return lookup, None
    best_cfg, best = lookup, simulate_lookup(lookup, ids, len(ids) // 2, costs)
    final = runtime.logits(captured["final"])  # [P, V]: the full head only once
    target = final.argmax(-1)
    if head is None:
        # Full-vocabulary drafting: score the exits over a proxy vocabulary, the union of
        # the full model's top candidates at the scored positions (an early exit that
        # agrees with the full model agrees on it too; a few chance agreements inside the
        # subset can only flatter a draft, and the online estimate corrects that).
        vocab = final.topk(min(CALIBRATION_PROXY_TOP, final.shape[-1]), dim=-1).indices.flatten().unique()
        head = runtime.head_columns(vocab).contiguous()
        head = runtime.prepare_weight(head)
    target_np = target.cpu().numpy()
    drafts: list[tuple[dict, Agreement]] = []  # (DraftConfig options, agreement)
    for E in sorted(k for k in captured if k != "final"):
        tok, conf = _argmax_conf(runtime, captured[E], head, vocab)
        drafts.append((dict(strategy="early-exit", exit_layer=E), Agreement(tok == target_np, conf)))
    if quantized is not None:
        bits, quant, (q_head, q_vocab), cache = quantized
        drafts.append((dict(strategy="quantized", draft_bits=bits),
                       quantized_agreement(runtime, quant, ids, cache, target_np, q_head, q_vocab)))
    candidates: list[tuple[DraftConfig, Prediction]] = []
    for options, cal in drafts:
        for k in range(1, CALIBRATION_MAX_K + 1):
            for lookup_first in (False, True):
                cfg = DraftConfig(**options, num_speculations=k, draft_vocab=draft_vocab, lookup_first=lookup_first,
                                  **({"max_ngram": auto_cfg.max_ngram} if lookup_first else {}))
                candidates.append((cfg, simulate(cfg, cal, costs, tokens=ids, start=len(ids) - len(cal.match))))
    top_cfg, top = max(candidates, key=lambda c: c[1].speedup)
    # Near ties go to the longer draft of the same kind: fixed per-step costs the model
    # leaves out (the engine's bookkeeping) favour fewer, longer steps (AutoDrafter._best_k).
    top_cfg, _ = max((c for c in candidates if (c[0].strategy, c[0].exit_layer, c[0].lookup_first)
                      == (top_cfg.strategy, top_cfg.exit_layer, top_cfg.lookup_first) and c[1].speedup >= top.speedup * 0.97),
                     key=lambda c: c[0].num_speculations)
    if top.speedup > best.speedup * 1.02:  # near ties go to the free lookup
        best_cfg, best = top_cfg, top
    return best_cfg, best
