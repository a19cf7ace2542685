"""Log-probabilities of generated tokens, as OpenAI defines them: of the distribution the token
was drawn from, i.e. the target's (the full model's) logits after the logits processors
(processors.py) and the sampling transform (temperature, top-k, top-p: sampling.py). Greedy
decoding draws from the processed logits at temperature 1 with nothing truncated (its token is
that distribution's mode). A token outside the support has log-probability -inf (OpenAI's
clients get -9999.0, as vLLM sends). The rows come from the verify pass that chose the token:
no forward pass of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from selfspec.config import SamplingConfig
from selfspec.sampling import Dist, Explicit, Softmax, distribution

FLOOR = -9999.0  # what a -inf log-probability is sent as (JSON has no infinity)
PROMPT_ROWS = 64  # scored_prompt: logits rows made at once (a row of a 262k vocabulary is 1 MB)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens of the distribution and their log-probabilities, best first


def drawn_from(sampling: SamplingConfig) -> SamplingConfig:
    """The sampling transform a token of `sampling` is drawn with (greedy: temperature 1, nothing truncated)."""
    return SamplingConfig(temperature=1.0) if sampling.greedy else replace(sampling, logit_bias=None, grammar=None)


def token_logprob(row: torch.Tensor, token: int, sampling: SamplingConfig, top: int, d: Dist | None = None) -> TokenLogprob:
    """The log-probability of `token` and the `top` most likely tokens under the distribution of
    processed logits row [V] (module doc); d: that distribution when acceptance built it already
    (distribution(row, drawn_from(sampling)))."""
    cfg = drawn_from(sampling)
    d = distribution(row, cfg) if d is None else d
    if isinstance(d, Softmax):  # log p_t = x_t - m - log z over {x >= tau}
        shift = d.m + math.log(d.z)
        x = row / cfg.temperature
        lp = float(x[token]) - shift if float(x[token]) >= d.tau else -math.inf
        if top:
            vals, ids = torch.topk(x, min(top, len(x)))
            alts = [(int(i), float(v) - shift) for v, i in zip(vals.tolist(), ids.tolist()) if v >= d.tau]
        return TokenLogprob(token, lp, alts if top else [])
    probs, ids = (d.probs, d.ids) if isinstance(d, Explicit) else (d.probs, None)
    p = d.prob(token)
    lp = math.log(p) if p > 0 else -math.inf
    alts = []
    if top:
        vals, idx = torch.topk(probs.double(), min(top, len(probs)))
        alts = [(int(ids[i]) if ids is not None else int(i), math.log(v)) for v, i in zip(vals.tolist(), idx.tolist()) if v > 0]
    return TokenLogprob(token, lp, alts)


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top: int) -> list[TokenLogprob | None]:
    """The prompt's tokens under the model's own distribution (log-softmax of its logits [P, V]
    at the prompt's positions; nothing is sampled there): entry i for ids[i], the first None
    (nothing precedes it)."""
    lsm = logits.double().log_softmax(-1)
    out: list[TokenLogprob | None] = [None]
    for i in range(1, len(ids)):
        row = lsm[i - 1]
        alts = []
        if top:
            vals, idx = torch.topk(row, min(top, row.shape[0]))
            alts = [(int(t), float(v)) for v, t in zip(vals.tolist(), idx.tolist())]
        out.append(TokenLogprob(ids[i], float(row[ids[i]]), alts))
    return out


def json_value(lp: float) -> float:
    return lp if lp > FLOOR else FLOOR


def scored_prompt(rt, ids: list[int], top: int) -> list[TokenLogprob | None]:
    """prompt_logprobs of ids on runtime rt: one pass over the prompt (a cache of its own), the
    logits made PROMPT_ROWS rows at a time."""
    with torch.inference_mode():
        h = rt.run_layers(rt.embed(torch.tensor(ids, device=rt.device)), 0, rt.num_layers, 0, rt.new_cache(len(ids) + 1))
        out: list[TokenLogprob | None] = [None]
        for a in range(0, len(ids) - 1, PROMPT_ROWS):
            b = min(a + PROMPT_ROWS, len(ids) - 1)
            out += prompt_logprobs(rt.logits(h[a:b]), ids[a : b + 1], top)[1:]
    return out
