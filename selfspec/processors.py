"""Logits processors: what a generation's options do to the logits of every position before the
sampling transform (sampling.py), for the target and the drafts alike.

In order, on the logits z of one position (fp32, a fresh row: changed in place):
  1. logit_bias (OpenAI): z_t += bias_t.
  2. repetition_penalty r (transformers' RepetitionPenaltyLogitsProcessor): for every token t
     of the prompt or the text so far, z_t / r if z_t > 0 else z_t * r.
  3. presence / frequency penalties (OpenAI): z_t -= presence * [c_t > 0] + frequency * c_t,
     c_t = how often t was generated so far (the prompt does not count).
  4. grammar (grammar.py): z_t = -inf for every token the grammar does not allow next.
  5. min_p (sampling only; after temperature, before top-k / top-p, as vLLM): with x = z / T,
     z_t = -inf where x_t < max(x) + ln(min_p), i.e. p_t < min_p * p_max.
"So far" at a verify row j is the committed context plus drafts 0..j-1; at a draft token, the
context plus the drafts before it: each position sees exactly what it would see in
autoregressive decoding, so greedy speculative output is autoregressive output and sampling
keeps its distribution (the processed distribution is the target).

A `Processing` holds one generation's state over its committed tokens (counts, the grammar
matcher); drafts are seen through `row(logits, drafted)` and verification through
`rows(logits, draft)`, and neither changes the committed state: `commit(tokens, rows)` does,
after acceptance (rejected drafts leave no trace: the matcher rolls back over them). With
`GenerationConfig.logprobs` it also records the log-probability of every committed token
(logprobs.py) from the rows it was chosen from: the verify pass's, no pass of its own.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

from selfspec.config import GenerationConfig, SamplingConfig
from selfspec.coupling import LazyRow
from selfspec.logprobs import TokenLogprob, drawn_from, token_logprob
from selfspec.sampling import Rows, SubVocab


def min_p_floor(x_max: torch.Tensor, min_p: float) -> torch.Tensor:
    """The least x = z / T that min_p keeps, from the row's largest x (a 0-dim fp32 tensor): one
    expression, so that every path (the full row, the screened pick) computes the same float."""
    return x_max + math.log(min_p)


class Entries:
    """The entries of a few known tokens, ids [n] (int64 ascending): entry j is token ids[j]. Read
    as Processing.edit reads a SubVocab (`ids`, `index[tokens]` -> entry or -1), without a
    vocabulary-sized index."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids.long()
        self.index = self

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        if not len(self.ids):
            return torch.full_like(tokens, -1)
        j = torch.searchsorted(self.ids, tokens).clamp(max=len(self.ids) - 1)
        return torch.where(self.ids[j] == tokens, j, -1)


class Processing:
    """One generation's processors and their state (module doc). `matcher`: the grammar's
    (grammar.Matcher), or None."""

    def __init__(self, sampling: SamplingConfig, gen: GenerationConfig, prompt_ids: Sequence[int], vocab_size: int,
                 matcher=None):
        self.sampling, self.top = sampling, gen.logprobs
        self.vocab_size = vocab_size
        self.alters = sampling.processed or matcher is not None  # drafts must see processed logits too
        self.matcher = matcher
        self.logprobs: list[TokenLogprob] = []
        bias = sampling.logit_bias.items if sampling.logit_bias is not None else ()
        self._bias_ids = torch.tensor([t for t, _ in bias if t < vocab_size], dtype=torch.long)
        self._bias = torch.tensor([b for t, b in bias if t < vocab_size], dtype=torch.float32)
        self._counts: Counter[int] = Counter()  # generated tokens
        self._seen: set[int] = set(prompt_ids) if sampling.repetition_penalty != 1.0 else set()
        self._committed()

    @classmethod
    def needed(cls, sampling: SamplingConfig, gen: GenerationConfig) -> bool:
        """Whether a generation with these options needs a Processing (processors, or logprobs)."""
        return sampling.processed or gen.logprobs is not None

    # ---- the committed state -------------------------------------------------------------

    def _committed(self) -> None:
        """Tensors of the committed state (rebuilt per commit: a step's rows share them): the
        penalised tokens and what the penalties subtract from them."""
        s = self.sampling
        ids = sorted(t for t in self._counts if t < self.vocab_size)
        self._gen_ids = torch.tensor(ids, dtype=torch.long)
        self._gen_minus = torch.tensor([self._minus(self._counts[t]) for t in ids], dtype=torch.float32)
        self._gen_index = {t: i for i, t in enumerate(ids)}
        self._seen_ids = torch.tensor(sorted(t for t in self._seen if t < self.vocab_size), dtype=torch.long)

    def commit(self, tokens: Sequence[int], rows: Sequence[torch.Tensor] | None = None) -> None:
        """tokens joined the context (the first from the prompt's row, or a step's accepted drafts
        and the verifier's token); rows[i]: the processed logits token i was chosen from (logprobs)."""
        if self.top is not None and rows is not None:
            for i, t in enumerate(tokens):
                d = rows.dists(drawn_from(self.sampling))[i] if isinstance(rows, ProcessedRows) else None
                self.logprobs.append(token_logprob(rows[i], t, self.sampling, self.top, d))
        if self.matcher is not None:
            self.matcher.commit(tokens)
        if self.sampling.presence_penalty or self.sampling.frequency_penalty:
            self._counts.update(tokens)
        if self.sampling.repetition_penalty != 1.0:
            self._seen.update(tokens)
        self._committed()

    # ---- processed rows ------------------------------------------------------------------

    def row(self, logits: torch.Tensor, drafted: Sequence[int] = (), sub: SubVocab | None = None) -> torch.Tensor:
        """The processed logits [N] of the position after the committed context and `drafted`
        (fp32, a new tensor; entry j is token j, or sub.ids[j] for a restricted draft head).
        The committed state's tensors apply as they are; the drafts add a few entries."""
        z = logits.detach().float().clone()
        if not self.alters:
            return z
        self.edit(z, drafted, sub)
        s = self.sampling
        if s.min_p and not s.greedy:
            x = z / s.temperature
            z.masked_fill_(x < min_p_floor(x.max(), s.min_p), float("-inf"))
        return z

    def edit(self, z: torch.Tensor, drafted: Sequence[int] = (), sub: SubVocab | Entries | None = None) -> None:
        """Every processor but min_p on z [N] in place (entry j: token j, or sub.ids[j]): each entry's
        new value is a function of its token and its own value alone, the same fp32 operations
        whichever entries z holds, and non-decreasing in the value (additions, the repetition
        penalty's z / r or z r by sign, -inf off the grammar): so it maps bounds on logits to bounds
        on the processed logits (sampled_head.py)."""
        s = self.sampling
        drafted = [t for t in drafted if t < self.vocab_size]
        if len(self._bias_ids):
            self._add(z, self._bias_ids, self._bias, sub)
        if s.repetition_penalty != 1.0:
            self._repeat(z, self._seen_ids, sub)
            new = sorted(set(drafted) - self._seen)
            if new:
                self._repeat(z, torch.tensor(new, dtype=torch.long), sub)
        if s.presence_penalty or s.frequency_penalty:
            ids, minus = self._penalties(drafted)
            if len(ids):
                self._add(z, ids, -minus, sub)
        if self.matcher is not None:
            allowed = self.matcher.allowed(drafted)  # bool [vocab]
            z.masked_fill_(~(allowed if sub is None else allowed[sub.ids]), float("-inf"))

    def _minus(self, count: int) -> float:
        """What presence and frequency subtract from a token generated `count` times (> 0): one
        expression, so that every path computes the same float."""
        return self.sampling.presence_penalty + self.sampling.frequency_penalty * count

    def _penalties(self, drafted: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, what each loses) after the committed tokens and `drafted`: the committed
        state's tensors, with the drafted tokens' entries recounted. A token both committed and
        drafted loses its total once, as on the autoregressive row that commits the drafts first
        (two subtractions would round twice)."""
        if not drafted:
            return self._gen_ids, self._gen_minus
        c = Counter(drafted)
        minus = self._gen_minus.clone()
        extra = sorted(t for t in c if t not in self._gen_index)
        for t in c:
            if t in self._gen_index:
                minus[self._gen_index[t]] = self._minus(self._counts[t] + c[t])
        if not extra:
            return self._gen_ids, minus
        ids = torch.cat([self._gen_ids, torch.tensor(extra, dtype=torch.long)])
        return ids, torch.cat([minus, torch.tensor([self._minus(c[t]) for t in extra], dtype=torch.float32)])

    def _add(self, z: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, sub: SubVocab | None) -> None:
        """z[token] += value (ids: token ids below vocab_size)."""
        if sub is None:
            z.index_add_(0, ids, values)
            return
        j = sub.index[ids]
        keep = j >= 0
        z.index_add_(0, j[keep], values[keep])

    def _repeat(self, z: torch.Tensor, ids: torch.Tensor, sub: SubVocab | None) -> None:
        if sub is not None:
            ids = sub.index[ids]
            ids = ids[ids >= 0]
        r = self.sampling.repetition_penalty
        v = z[ids]
        z[ids] = torch.where(v > 0, v / r, v * r)

    def rows(self, logits: torch.Tensor, draft: Sequence[int]) -> ProcessedRows:
        """The verify rows [k+1, V] of a step that drafted `draft`, processed lazily (row j after
        draft[:j])."""
        return ProcessedRows(self, logits, list(draft))

    def forced(self, most: int) -> tuple[list[int], int]:
        """(tokens the grammar forces next, how many of them certainly) as free drafts
        (grammar.Matcher.forced); nothing without a grammar."""
        return self.matcher.forced(most) if self.matcher is not None and most > 0 else ([], 0)


class ProcessedRows(Sequence):
    """Row j: Processing.row(logits[j], draft[:j]), made on first use (acceptance stops at the
    first rejection; rows are asked for in order). Quacks like the logits tensor where
    sampling.Rows and GumbelPicks read one (`shape`, `[j]`). `dists(cfg)`: the rows'
    distributions under a sampling transform, made once, which acceptance and the logprobs of the
    tokens it accepts share (a truncated one is a pass over the vocabulary)."""

    def __init__(self, proc: Processing, logits: torch.Tensor, draft: list[int]):
        self.proc, self.logits, self.draft = proc, logits, draft
        self.shape = logits.shape
        self._rows: dict[int, torch.Tensor] = {}
        self._dists: dict[tuple, Rows] = {}

    def dists(self, cfg: SamplingConfig) -> Rows:
        """sampling.Rows of these rows under cfg's transform (one per transform: each row's made once)."""
        key = (cfg.temperature, cfg.top_k, cfg.top_p)
        if key not in self._dists:
            self._dists[key] = Rows(self, cfg)
        return self._dists[key]

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, j):
        if j not in self._rows:
            row = self.logits[j]
            drafted = self.draft[:j]
            self._rows[j] = ProcessedRow(self.proc, row, drafted) if isinstance(row, LazyRow) else self.proc.row(row, drafted)
        return self._rows[j]


class ProcessedRow(LazyRow):
    """Processing.row(row.full(), drafted) of a row not computed yet (sampled_head.HeadRow): its
    Gumbel-max or argmax token picked through the screened head with these processors (`edit`,
    `allowed`, `min_p`: what sampled_head.py reads), the full row made only where the screen
    cannot decide."""

    def __init__(self, proc: Processing, row: LazyRow, drafted: list[int]):
        self.proc, self.row, self.drafted = proc, row, drafted
        s = proc.sampling
        self.min_p = s.min_p if s.min_p and not s.greedy else 0.0
        self._full: torch.Tensor | None = None

    def full(self) -> torch.Tensor:
        if self._full is None:
            self._full = self.proc.row(self.row.full(), self.drafted)
        return self._full

    def edit(self, z: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """Processing.edit on z in place: every token's entry, or entry j token ids[j] (ascending)."""
        self.proc.edit(z, self.drafted, None if ids is None else Entries(ids))

    def allowed(self) -> torch.Tensor | None:
        """The grammar's mask (bool [vocab]) at this row, or None."""
        if self.proc.matcher is None:
            return None
        return self.proc.matcher.allowed([t for t in self.drafted if t < self.proc.vocab_size])  # as edit asks it

    def gumbel(self, cfg: SamplingConfig, key: int, pos: int) -> int | None:
        return self.row.gumbel(cfg, key, pos, self)

    def argmax(self) -> int:
        """The processed row's argmax (first index on ties), as Argmaxes takes it from a full row."""
        token = self.row.argmax(self)
        return int(self.full().argmax()) if token is None else token


class Argmaxes(Sequence):
    """Greedy targets of processed rows: token j = argmax of rows[j] (first index on ties, as
    Runtime.argmax), made on first use."""

    def __init__(self, rows: Sequence[torch.Tensor]):
        self.rows = rows
        self._tokens: dict[int, int] = {}

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, j):
        if j not in self._tokens:
            self._tokens[j] = int(self.rows[j].argmax())
        return self._tokens[j]
