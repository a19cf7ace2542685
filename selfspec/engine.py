"""The engine loop: prefill, then draft -> verify -> accept until a stop condition.

    pending = first token sampled from the prompt's logits
    loop (one speculative step: step.py, the batch engine's too):
        draft  = drafter.draft(step)                  # k proposals from part of the model
        logits = drafter.verify(step, draft)          # full model over pending + drafts
        n, nxt = accept(draft, logits)                # greedy prefix / speculative sampling
        commit draft[:n] + [nxt]; pending = nxt       # rejected KV rows: just not committed

Autoregressive decoding is the same loop with drafts of length 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from selfspec.config import MAX_SPECULATIONS, GenerationConfig, SamplingConfig
from selfspec.drafters.base import Draft, Drafter, Step
from selfspec.coupling import gumbel_token, noise_key
from selfspec.logprobs import TokenLogprob
from selfspec.processors import Processing
from selfspec.sampling import distribution, make_rng
from selfspec.step import speculative_step


@dataclass
class GenerationStats:
    new_tokens: int = 0
    prompt_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    time_prefill_s: float = 0.0
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0
    time_s: float = 0.0
    time_to_first_token_s: float = 0.0
    longest_stall_s: float = 0.0  # batch engine: the longest wait between two deliveries of new tokens
    free_drafted: int = 0  # tokens a grammar forced, drafted for free (no drafter ran; not in drafted)
    free_accepted: int = 0  # of those, accepted (the certain ones always are)
    draft: dict | None = None  # what drafted: the configuration and its label (auto: the draft it gated, and where it came from)

    def count_step(self, drafted: int, accepted: int) -> None:
        """One verify step that checked `drafted` drafts and kept the first `accepted`."""
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        for _ in range(drafted - len(self.per_position_drafted)):  # a copied tail (Draft.tail) can pass K
            self.per_position_drafted.append(0)
            self.per_position_accepted.append(0)
        for i in range(drafted):
            self.per_position_drafted[i] += 1
            self.per_position_accepted[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verify step, the verifier's own token and free drafts included."""
        return (self.accepted + self.free_accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def time_other_s(self) -> float:
        return max(self.time_s - self.time_prefill_s - self.time_draft_s - self.time_verify_s, 0.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("acceptance_rate", "mean_accepted_length", "tokens_per_second", "time_other_s"):
            d[name] = getattr(self, name)
        return d


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # new tokens only
    prompt_tokens: int
    finish_reason: str  # "eos" | "stop" | "length"
    stats: GenerationStats
    drafted_mask: list[bool]  # per new token: was it a draft the verifier accepted?
    logprobs: list[TokenLogprob] | None = None  # per new token (GenerationConfig.logprobs): logprobs.py

    def to_dict(self) -> dict:
        d = {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            d["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top": e.top} for e in self.logprobs]
        return d


@dataclass
class StreamEvent:
    text: str  # text delta since the previous event (may be empty mid-character)
    token_id: int
    drafted: bool  # True: an accepted draft token; False: produced by the verifier
    logprob: TokenLogprob | None = None  # with GenerationConfig.logprobs


class _Output:
    """Collects committed tokens one at a time and applies the stop rules exactly as plain
    decoding would: EOS and gen.stop_token_ids (kept in token_ids, not in text; finish "eos"
    and "stop"), max_new_tokens, stop strings (text cut before the stop string; token_ids keep
    the token that completed it)."""

    def __init__(self, tokenizer, gen: GenerationConfig, eos_ids, on_event):
        self.tok = tokenizer
        self.gen = gen
        self.eos = set(eos_ids)
        self.stop_ids = set(gen.stop_token_ids) - self.eos
        self.on_event = on_event
        self.ids: list[int] = []
        self.drafted: list[bool] = []
        self.text = ""
        self.finish: str | None = None
        self._track_text = bool(gen.stop) or on_event is not None
        self._emitted = 0
        self._ended_by_token = False

    def _decode(self) -> str:
        ids = self.ids[:-1] if self._ended_by_token else self.ids  # EOS, a stop token: in token_ids, never in text
        return self.tok.decode(ids, skip_special_tokens=True) if self.tok is not None else ""

    def push(self, tokens: list[int], drafted: list[bool], logprobs: list[TokenLogprob] | None = None) -> None:
        for i, (t, d) in enumerate(zip(tokens, drafted)):
            if self.finish is not None:
                return
            self.ids.append(t)
            self.drafted.append(d)
            if t in self.eos or t in self.stop_ids:
                self.finish = "eos" if t in self.eos else "stop"
                self._ended_by_token = True
                if self._track_text:
                    self.text = self._decode()  # a stop token's own text never shows
            elif self._track_text:
                self._update_text()
            if self.finish is None and len(self.ids) >= self.gen.max_new_tokens:
                self.finish = "length"
            if self.on_event is not None:
                self._emit(t, d, logprobs[i] if logprobs else None)

    def _update_text(self) -> None:
        text = self._decode()
        if self.gen.stop:
            longest = max(len(s) for s in self.gen.stop)
            start = max(0, len(self.text) - longest)
            hits = [i for i in (text.find(s, start) for s in self.gen.stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                self.finish = "stop"
        self.text = text

    def _emit(self, token: int, drafted: bool, logprob: TokenLogprob | None) -> None:
        text = self.text
        safe = len(text)
        if self.finish is None:
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
                safe -= 1
            safe -= self._stop_prefix_len(text[:safe])  # might become a stop string: wait
        delta = text[self._emitted : safe] if safe > self._emitted else ""
        self._emitted = max(self._emitted, safe)
        self.on_event(StreamEvent(delta, token, drafted, logprob))

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.gen.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def final_text(self) -> str:
        return self.text if self._track_text else self._decode()


def sample_token(logits: torch.Tensor | int, sampling: SamplingConfig, rng: torch.Generator, key: int | None, pos: int,
                 proc: Processing | None = None) -> int:
    """The token at position pos from the logits [V] before it (greedy: the argmax token the
    pass gave, or with processors the processed row's argmax): Gumbel-max with the noise of
    (key, pos), or a draw from rng (key None). proc: the generation's processors, which the
    token is committed to."""
    row = None
    if proc is not None:
        logits = row = proc.row(logits)
        if sampling.greedy:
            logits = int(row.argmax())
    if sampling.greedy:
        token = logits
    else:
        token = gumbel_token(logits, sampling, key, pos) if key is not None else distribution(logits, sampling).draw(rng)
    if proc is not None:
        proc.commit([token], [row])
    return token


def generate(
    runtime,
    drafter: Drafter,
    prompt_ids: list[int],
    gen: GenerationConfig,
    sampling: SamplingConfig,
    tokenizer=None,
    eos_ids: tuple[int, ...] = (),
    on_event: Callable[[StreamEvent], None] | None = None,
    proc: Processing | None = None,
) -> GenerationResult:
    """proc: the generation's logits processors and logprobs (processors.py; None: none)."""
    clock = time.perf_counter
    t_start = clock()
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    rng = make_rng(sampling.seed, runtime.device)
    key = noise_key(sampling)  # Gumbel-max coupling: the text is a function of the key and the target alone
    # One capacity for every strategy (prompt + budget + the largest draft): identical
    # attention shapes are part of what keeps speculative output bit-identical.
    cache = runtime.new_cache(len(prompt_ids) + gen.max_new_tokens + MAX_SPECULATIONS + 2)
    out = _Output(tokenizer, gen, eos_ids, on_event)

    with torch.inference_mode():
        ids = torch.tensor(prompt_ids, device=runtime.device)
        first = sample_token(drafter.prefill(ids, cache, argmax_only=sampling.greedy and proc is None), sampling, rng, key,
                             len(prompt_ids), proc)
        K = drafter.max_draft  # after prefill: auto picks its base draft there
        stats.per_position_drafted, stats.per_position_accepted = [0] * K, [0] * K
        stats.time_prefill_s = clock() - t_start
        stats.time_to_first_token_s = stats.time_prefill_s
        tokens = list(prompt_ids) + [first]
        out.push([first], [False], proc.logprobs[-1:] if proc is not None and proc.top is not None else None)
        while out.finish is None:
            remaining = gen.max_new_tokens - len(out.ids)
            step = Step(tokens, len(tokens) - 1, min(K, remaining - 1), cache, sampling, rng, key=key, proc=proc)
            o = speculative_step(drafter, step, remaining, clock)
            stats.time_draft_s += o.draft_s
            stats.time_verify_s += o.verify_s
            count(stats, o.draft, o.accepted)
            tokens.extend(o.tokens)
            out.push(o.tokens, o.drafted, o.logprobs)
    stats.time_s = clock() - t_start
    stats.new_tokens = len(out.ids)
    stats.draft = drafter.describe()
    return GenerationResult(out.final_text(), out.ids, len(prompt_ids), out.finish, stats, out.drafted, recorded(proc, out.ids))


def count(stats: GenerationStats, draft: Draft, n: int) -> None:
    """A verify step's counts: the drafter's drafts, or a grammar's free ones."""
    if draft.free:
        stats.count_step(0, 0)
        stats.free_drafted += len(draft.tokens)
        stats.free_accepted += n
    else:
        stats.count_step(len(draft.tokens), n)


def recorded(proc: Processing | None, ids: list[int]) -> list[TokenLogprob] | None:
    """The logprobs of a generation's tokens (those past a stop condition were never output)."""
    return proc.logprobs[: len(ids)] if proc is not None and proc.top is not None else None
