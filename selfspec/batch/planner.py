"""Speculation that knows the batch: how many tokens each sequence drafts this step.

One batched step costs the draft forwards plus ONE verify pass over every row of every
sequence (pending token + drafts) and the prefill rows riding along. Rows are nearly free
while a pass is bound by streaming the weights and cost their arithmetic once it is bound
by compute, so the same draft that pays for one sequence may not pay in a batch of 16
(llama.cpp's lookup decoding: faster at 1 slot, slower at 8; benchmarks/RESULTS.md). The planner maximises the batch's
expected tokens per second

    sum_i E[N](alpha_i, k_i) / (t_draft(k) + t_verify(P + sum_i (k_i + 1)))

over k_i in 0..cap_i, greedily: starting from k = 0, repeatedly take the move that raises
the objective most (more tokens for one sequence, or for every sequence sharing a draft
forward), until none does. E[N] grows by alpha_i^(k_i+1) per token; t_verify comes from BatchCosts measured over total row counts (the per-sequence
predictor.costs stops at 17 rows), and a self-draft's extra token costs the rows it adds
to its group's draft forwards (timed per draft signature on first use: measure_draft). Decisions never change output (every draft is verified);
they are used for greedy decoding only (module sequence.py says why not when sampling).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from selfspec.cache import SegmentTable
from selfspec.predictor.costs import load_stored, save_stored, time_alternating, time_call

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
# A plan must beat drafting nothing by this factor: a smaller predicted gain is within the
# error of the cost tables and acceptances (at 8 sequences of the default model a plan
# predicted a few percent faster measured no faster than plain decoding; benchmarks/RESULTS.md).
MARGIN = 1.05


@dataclass
class BatchCosts:
    """Seconds of a batched pass at each total row count (ROWS; others interpolate)."""

    layers: dict[int, float]  # all layers over R rows (spread over several sequences)
    head: dict[int, float]  # final norm + LM head over R rows, argmax only (the planner plans greedy rows)
    overhead: float = 2e-4  # per forward call (Python, tables)
    _draft_cache: dict = field(default_factory=dict)
    _memo: dict = field(default_factory=dict)  # (what, rows...) -> seconds: the planner asks the same often
    _reference: object = None  # weakref to the runtime `layers` timed (measure()): draft forwards are timed against it
    # Draft tables by a stable name of their signature (kept on disk with the rest: resources.py),
    # the namer that gives it (None for a signature it cannot name), and what to call after a new one
    drafts: dict[str, dict[int, float]] = field(default_factory=dict)
    namer: object = None
    on_new_draft: object = None

    @classmethod
    def measure(cls, rt, repeats: int = 3, context: int = 64) -> "BatchCosts":
        layers, head = {}, {}
        H, gen = rt.spec.hidden_size, torch.Generator().manual_seed(0)
        caches = [rt.new_cache(context + 2 * max(ROWS)) for _ in range(8)]
        with torch.inference_mode():
            for r in ROWS:
                table = _spread(caches, r, context)
                h = (torch.randn(r, H, generator=gen) * 0.1).to(rt.device, rt.dtype)
                layers[r] = time_call(lambda: rt.run_layers_batch(h, 0, rt.num_layers, table), repeats)
                head[r] = time_call(lambda: rt.argmax(h), repeats)
        costs = cls(_monotone(layers), _monotone(head))
        costs._reference = weakref.ref(rt)  # weak: the runtime -> costs cache must not keep its runtime alive
        return costs

    @staticmethod
    def _interp(table: dict[int, float], rows: float) -> float:
        if rows <= 0:
            return 0.0
        xs = sorted(table)
        if rows > xs[-1]:  # beyond the table: linear in rows from the last two points
            a, b = xs[-2], xs[-1]
            return table[b] + (rows - b) * (table[b] - table[a]) / (b - a)
        return float(np.interp(rows, xs, [table[x] for x in xs]))

    def verify(self, rows: int, logit_rows: int | None = None) -> float:
        """A pass over `rows` rows with logits for `logit_rows` of them (default all)."""
        if rows <= 0:
            return 0.0
        lr = rows if logit_rows is None else logit_rows
        t = self._memo.get((rows, lr))
        if t is None:
            t = self._memo[(rows, lr)] = self.overhead + self._interp(self.layers, rows) + self._interp(self.head, lr)
        return t

    def draft_step(self, signature: tuple, rows: int) -> float:
        """One batched draft forward of `rows` sequences with this draft signature (draft
        runtime, exit layer, draft head, skip sets; batch.passes.signature), timed on first
        use at DRAFT_ROWS, the very calls draft_depth makes, interleaved with the measured
        runtime's layer pass and expressed in the `layers` table's time (measure_draft: the
        machine drifts between the two timings). Measured, not scaled by bytes:
        a quantized copy that reads half the bytes of bf16 is as dear per row once several
        rows make its kernel compute-bound (for the int8 copy of the default model on the
        2-core reference machine, several times the bytes-scaled estimate at 8 rows)."""
        if rows <= 0:
            return 0.0
        key = tuple(id(x) if not isinstance(x, (int, frozenset, tuple)) else x for x in signature)
        t = self._memo.get((key, rows))
        if t is None:
            if key not in self._draft_cache:
                name = self.namer(signature) if self.namer is not None else None
                if name is not None and name in self.drafts:  # timed by an earlier process on this machine
                    self._draft_cache[key] = self.drafts[name]
                else:
                    ref = self._reference() if self._reference is not None else None
                    self._draft_cache[key] = measure_draft(*signature) if ref is None else \
                        measure_draft(*signature, reference=(ref, self.layers))
                    if name is not None:
                        self.drafts[name] = self._draft_cache[key]
                        if self.on_new_draft is not None:
                            self.on_new_draft(self)
            t = self._memo[(key, rows)] = self.overhead + self._interp(self._draft_cache[key], rows)
        return t

    def to_dict(self) -> dict:
        """The measured tables (the file kept_costs keeps)."""
        return {"layers": self.layers, "head": self.head, "overhead": self.overhead, "drafts": self.drafts}

    @classmethod
    def from_dict(cls, d: dict, runtime=None) -> "BatchCosts":
        """Tables saved by to_dict; `runtime`: the one they were timed on (new draft tables are
        timed against it, as after measure())."""
        table = lambda t: {int(k): float(v) for k, v in t.items()}  # noqa: E731
        costs = cls(table(d["layers"]), table(d["head"]), float(d["overhead"]),
                    drafts={str(k): table(v) for k, v in d.get("drafts", {}).items()})
        if runtime is not None:
            costs._reference = weakref.ref(runtime)
        return costs


KEPT_FORMAT = "selfspec-batch-costs/1"


def kept_costs(res) -> BatchCosts:
    """A model's pass costs (res: its resources.DraftResources): measured once per model and
    machine (a second or two on the default model, which the first generate_batch of every
    process used to pay: a slow first call), kept on disk beside the primitive costs with the
    same identity, and the draft tables timed on first use kept with them. A model without a
    fingerprint measures them once per process."""
    return res.once("batch_costs", lambda: _load_or_measure(res))


def _load_or_measure(res) -> BatchCosts:
    ident = res.stored_identity("batch")
    saved = load_stored(ident, KEPT_FORMAT) if ident else None
    costs = None
    if saved is not None:
        try:
            costs = BatchCosts.from_dict(saved, res.runtime)
        except (KeyError, TypeError, ValueError, AttributeError):
            costs = None
    if costs is None:
        with res.runtime.compute_scope():  # timed as batches run them
            costs = BatchCosts.measure(res.runtime)
    if ident:
        costs.namer = res.draft_name
        costs.on_new_draft = lambda c: save_stored(ident, KEPT_FORMAT, c.to_dict())
        if saved is None:
            save_stored(ident, KEPT_FORMAT, costs.to_dict())
    return costs


DRAFT_ROWS = (1, 2, 4, 8, 16, 32)


def measure_draft(draft_rt, exit_layer: int, head, skip_attn=frozenset(), skip_mlp=frozenset(),
                  reference: tuple | None = None, repeats: int = 3, context: int = 64) -> dict[int, float]:
    """Seconds of one batched draft forward at each DRAFT_ROWS row count (one row per
    sequence, rows spread over up to 8 caches as passes.draft_depth spreads them).

    reference = (rt, layers table): each draft forward is timed alternately with rt's full
    layer pass over the same rows and the result given in the table's time,
    draft / layers-now * table[r]. The planner weighs draft seconds against verify seconds
    from tables timed seconds or minutes apart on a machine whose speed drifts (by half between
    processes on the reference VM): timed apart, the default model's int8 draft measured about
    half the layer pass in two processes and nearly all of it in a third, which then never drafted
    at 4 sequences, where drafting pays (benchmarks/RESULTS.md)."""
    rt, table = reference if reference is not None else (None, None)
    out = {}
    caches = [draft_rt.new_cache(context + max(DRAFT_ROWS)) for _ in range(8)]
    ref_caches = caches
    if rt is not None and rt is not draft_rt:  # a quantized copy: the verifier's caches are its own
        ref_caches = [rt.new_cache(context + max(DRAFT_ROWS)) for _ in range(8)]
    with torch.inference_mode():
        for r in DRAFT_ROWS:
            spread = _spread(caches, r, context)
            toks = torch.arange(r, device=draft_rt.device) % max(1, draft_rt.spec.vocab_size)

            def fn():
                h = draft_rt.run_layers_batch(draft_rt.embed(toks), 0, exit_layer, spread, skip_attn, skip_mlp)
                draft_rt.logits(h, head=head)

            if rt is None:
                out[r] = time_call(fn, repeats)
                continue
            ref_spread = _spread(ref_caches, r, context)
            h_ref = rt.embed(toks % rt.spec.vocab_size)
            ref_fn = lambda: rt.run_layers_batch(h_ref, 0, rt.num_layers, ref_spread)  # noqa: E731
            t_draft, t_ref = time_alternating(fn, ref_fn, repeats)
            out[r] = t_draft / t_ref * BatchCosts._interp(table, r)
    return _monotone(out)


def _spread(caches: list, rows: int, context: int) -> SegmentTable:
    """`rows` rows over min(rows, len(caches)) sequences at position `context`, as a decoding
    batch has them."""
    n = min(rows, len(caches))
    sizes = [rows // n + (i < rows % n) for i in range(n)]
    return SegmentTable([(c, context, s) for c, s in zip(caches, sizes)])


def _monotone(table: dict[int, float]) -> dict[int, float]:
    """More rows never cost less (noise must not say otherwise)."""
    xs = sorted(table)
    for a, b in zip(xs, xs[1:]):
        table[b] = max(table[b], table[a])
    return table


def expected_gain(alpha: float, k: int) -> float:
    """E[N](alpha, k+1) - E[N](alpha, k): the (k+1)-th draft token is worth alpha^(k+1)."""
    return alpha ** (k + 1)


def plan(costs: BatchCosts, seqs: list, caps: list[int], groups: list, prefill_rows: int, prefill_logits: int) -> list[int]:
    """Draft lengths k_i (0..caps[i]) maximising expected tokens per second of this step."""
    return plan_with_probes(costs, seqs, caps, groups, prefill_rows, prefill_logits)[0]


def plan_with_probes(costs: BatchCosts, seqs: list, caps: list[int], groups: list, prefill_rows: int,
                     prefill_logits: int, scales: tuple[float, float] = (1.0, 1.0)) -> tuple[list[int], list[bool]]:
    """(k, worth_probing): draft lengths k_i (0..caps[i]) maximising expected tokens per second
    of this step, and for each sequence whether one draft token would pay if it were surely
    accepted. A sequence kept at 0 only because rows are dear (a compute-bound step: a big
    batch, a prefill chunk riding along) has nothing to learn from a probe; one kept at 0 for
    its low acceptance does.
    groups[i]: None (free drafts) or the draft signature (draft_rt, exit, head, skips...) of sequence i.
    scales: (draft, verify) multipliers of the measured tables (the engine's running ratio of
    seconds taken to seconds predicted: the tables were timed once, the machine drifts).
    Each round takes the move that raises the objective most (_Plan.moves), until none does;
    a plan that beats drafting nothing by less than MARGIN is dropped."""
    p = _Plan(costs, seqs, caps, groups, prefill_rows, prefill_logits, scales)
    plain = p.value
    while (best := p.best_move()) is not None:
        p.take(*best)
    if p.value < plain * MARGIN:  # a predicted gain inside the tables' error: decode plainly
        p = _Plan(costs, seqs, caps, groups, prefill_rows, prefill_logits, scales)
    return p.k, p.worth()


class _Plan:
    """The planner's state: draft lengths k, expected tokens (gain), verify rows and draft
    seconds so far, and the objective value = gain / (t_draft + t_verify(rows))."""

    def __init__(self, costs: BatchCosts, seqs: list, caps: list[int], groups: list, prefill_rows: int,
                 prefill_logits: int, scales: tuple[float, float]):
        n = self.n = len(seqs)
        self.costs, self.caps, self.groups = costs, caps, groups
        self.prefill_rows, self.prefill_logits = prefill_rows, prefill_logits
        self.alphas = [s.alpha for s in seqs]
        self.k = [0] * n
        self.gain, self.rows, self.t_draft = float(n), prefill_rows + n, 0.0  # every sequence gets its verifier token
        sd, self.sv = scales
        # A group's draft forward at r rows, r = 0..n (draft step j runs the group's sequences
        # with k_i > j): looked up once here, not per candidate move.
        self.fwd = {g: [sd * costs.draft_step(g, r) for r in range(n + 1)] for g in set(groups) if g is not None}
        self.per_group: dict = {g: [] for g in self.fwd}  # g -> its sequences drafting at each draft step j
        self.members = {g: [i for i in range(n) if groups[i] == g] for g in self.fwd}
        # The prefill chunk riding along is paid whatever is drafted: decoding is charged only
        # what its rows add to the pass. Charging the whole pass would make every draft token
        # look cheap next to it and the batch would draft hard exactly when rows are dearest
        # (measured: 16 sequences drafted ~30 tokens a step during prefill, then finished
        # unevenly and decoded the tail at low occupancy: slower than autoregressive).
        self.base = self.sv * costs.verify(prefill_rows, prefill_logits) if prefill_rows else 0.0
        self._tv: dict[int, float] = {}
        self.value = self.gain / (self.t_draft + self.t_verify(self.rows))

    def t_verify(self, r: int) -> float:  # floored: a noisy flat table must not make decode rows free (or divide by 0)
        t = self._tv.get(r)
        if t is None:
            t = self._tv[r] = max(self.sv * self.costs.verify(r, r - self.prefill_rows + self.prefill_logits) - self.base, 1e-6)
        return t

    def added_cost(self, g, levels: dict[int, int]) -> float:
        """Draft seconds that `levels` (draft step j -> sequences added at it) add to group g."""
        steps, f = self.per_group[g], self.fwd[g]
        total = 0.0
        for j, a in levels.items():
            r = steps[j] if j < len(steps) else 0  # sequences already drafting at step j
            total += f[r + a] - f[r]
        return total

    def moves(self):
        """(grants {i: m_i}, expected tokens added, draft seconds added, rows added) of every
        candidate: a run of m >= 1 tokens for one sequence (a run, not one token: a
        self-draft's first token pays a whole draft forward), or m more for every sequence of
        one draft group at once (their forwards are shared: at 8 sequences one int8 draft
        forward costs well under twice one sequence's, so no single sequence's token pays for it while
        the group's eight do)."""
        k, caps, groups, alphas = self.k, self.caps, self.groups, self.alphas
        seen = set()
        for i in range(self.n):
            state = (alphas[i], k[i], caps[i], groups[i])  # equal states, equal moves: the first stands for all
            if state in seen:
                continue
            seen.add(state)
            dg = dt = 0.0
            for m in range(1, caps[i] - k[i] + 1):
                j = k[i] + m - 1
                dg += expected_gain(alphas[i], j)
                if groups[i] is not None:
                    dt += self.added_cost(groups[i], {j: 1})
                yield {i: m}, dg, dt, m
        for g, idx in self.members.items():
            open_ = [i for i in idx if k[i] < caps[i]]
            if len(open_) < 2:
                continue
            for m in range(1, max(caps[i] - k[i] for i in open_) + 1):
                grants = {i: min(m, caps[i] - k[i]) for i in open_}
                levels: dict[int, int] = {}
                dg = 0.0
                for i, mi in grants.items():
                    for j in range(k[i], k[i] + mi):
                        levels[j] = levels.get(j, 0) + 1
                        dg += expected_gain(alphas[i], j)
                yield grants, dg, self.added_cost(g, levels), sum(grants.values())

    def best_move(self):
        best, best_v = None, self.value * 1.0001
        for grants, dg, dt, dr in self.moves():
            v = (self.gain + dg) / (self.t_draft + dt + self.t_verify(self.rows + dr))
            if v > best_v:
                best, best_v = (grants, dg, dt, dr, v), v
        return best

    def take(self, grants: dict[int, int], dg: float, dt: float, dr: int, value: float) -> None:
        for i, m in grants.items():
            g = self.groups[i]
            if g is not None:
                steps = self.per_group[g]
                for j in range(self.k[i], self.k[i] + m):
                    while len(steps) <= j:
                        steps.append(0)
                    steps[j] += 1
            self.k[i] += m
        self.gain, self.rows, self.t_draft, self.value = self.gain + dg, self.rows + dr, self.t_draft + dt, value

    def worth(self) -> list[bool]:
        """Whether one more surely accepted token of each sequence would raise the objective."""
        return [self.caps[i] > 0 and (self.gain + 1.0) / (
            self.t_draft + (0.0 if self.groups[i] is None else self.added_cost(self.groups[i], {self.k[i]: 1}))
            + self.t_verify(self.rows + 1)) > self.value * 1.0001 for i in range(self.n)]


def predicted(costs: BatchCosts, ks: list[int], groups: list, rows: int, logit_rows: int) -> tuple[float, float]:
    """(draft, verify) seconds the tables predict for a plan: each group's draft forwards (draft
    step j runs its sequences with k_i > j) and one verify pass over `rows` rows."""
    draft = 0.0
    for g in {g for g in groups if g is not None}:
        mine = [k for k, h in zip(ks, groups) if h == g]
        draft += sum(costs.draft_step(g, sum(k > j for k in mine)) for j in range(max(mine, default=0)))
    return draft, costs.verify(rows, logit_rows)


class CostScale:
    """Running ratios of measured to predicted seconds (draft forwards, verify passes), so that
    the planner weighs the two at today's speeds: both are measured in the same steps, so a
    drift of the machine (large over minutes on the reference VM) cancels out of the choice."""

    def __init__(self, weight: float = 0.2):
        self.draft, self.verify, self.weight = 1.0, 1.0, weight
        self.draft_seen = False  # until a draft forward is timed, it drifts as the verify pass does

    def observe(self, predicted_s: tuple[float, float], measured_s: tuple[float, float]) -> None:
        for name, p, m in zip(("draft", "verify"), predicted_s, measured_s):
            if p > 0 and m > 0:
                ratio = min(4.0, max(0.25, m / p))
                if name == "draft" and not self.draft_seen:  # start from the verify pass's drift
                    self.draft, self.draft_seen = self.verify, True
                setattr(self, name, (1 - self.weight) * getattr(self, name) + self.weight * ratio)

    @property
    def scales(self) -> tuple[float, float]:
        """(draft, verify): the draft tables are in the layer table's time (measure_draft)."""
        return (self.draft if self.draft_seen else self.verify), self.verify


def prompt_group(costs: BatchCosts, lengths: list[int], cap: int, later_cap: int | None = None) -> int:
    """How many of the waiting prompts (whole, `lengths` rows each, in the order they are
    served) the next pass takes, so that their summed time to first token is least.

    A pass of R prompt rows costs t(R, m) = costs.verify(R, m) (m: its prompts' last rows,
    which get logits); every prompt not yet served waits for it. Over the partitions of the
    order into consecutive passes of at most `cap` rows (a prompt alone may exceed it):

        T(i) = min_j  t(rows[i:j], j - i) * (n - i) + T(j),    T(n) = 0

    and the answer is the first pass of the best partition (later passes within `later_cap`:
    the engine's cap once streams decode). Why not always as many as fit: a pass has a fixed
    part (every weight streamed, the head's rows) that grouping shares, and a part per row that
    it does not; on 2 cores eight 13-19-row prompts arriving together (in process, the default
    model) reached their first tokens sooner on average in the partition this picks than in
    passes of at most 64 rows (the figures: docs/serving.md)."""
    n = len(lengths)
    best, first = [0.0] * (n + 1), [1] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i], rows = float("inf"), 0
        for j in range(i + 1, n + 1):
            rows += lengths[j - 1]
            if rows > (cap if i == 0 or later_cap is None else later_cap) and j > i + 1:
                break
            t = costs.verify(rows, j - i) * (n - i) + best[j]
            if t < best[i]:
                best[i], first[i] = t, j - i
    return first[0] if n else 0
