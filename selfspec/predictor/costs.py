"""Measured costs of the runtime's primitives, from which the time of any drafting step is
modelled (this is what makes a search trial cheap and auto's decisions arithmetic).

`CostModel.measure` times the attention / MLP sub-layers (from memory, as a step reads them)
and the LM head at each row count a step uses (ROWS) on a scratch cache; `t_draft` and
`t_verify` of any strategy are sums of these parts. Measurements are kept on disk per
machine/model/build identity (`load_costs` / `save_costs`), so auto's decisions, and with them
how sampling consumes the RNG, are the same on every load on one machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from selfspec.config import MAX_SPECULATIONS, DraftConfig
from selfspec.loading import cache_root
from selfspec.profiles import atomic_write_text

ROWS = (1, 2, 3, 5, 9, MAX_SPECULATIONS + 1)  # row counts timed; others interpolate
FORMAT = "selfspec-costs/5"  # 5: sub-layers timed from memory (CostModel.measure)


def head_key(n: int | None, bits: int | None) -> int | str:
    """The key of a draft head's cost: its vocabulary size (the model's own head restricted),
    or "N/bits" for a quantized one ("full/8": all of the vocabulary, int8)."""
    return n if bits is None else f"{n or 'full'}/{bits}"


def _interp(table: dict[int, float], rows: int) -> float:
    xs = sorted(table)
    return float(np.interp(rows, xs, [table[x] for x in xs]))


def time_alternating(f, g, repeats: int) -> tuple[float, float]:
    """(min seconds of f, min seconds of g) over `repeats` calls of each, taking turns after one
    untimed call of each: each is timed right after the other, so neither finds its data still
    in cache from its own previous call."""
    f(), g()
    tf, tg = [], []
    for _ in range(repeats):
        tf.append(_seconds(f))
        tg.append(_seconds(g))
    return min(tf), min(tg)


def time_after(fn, before, repeats: int) -> float:
    """Min seconds of fn over `repeats` calls, each right after an untimed call of `before`."""
    ts = []
    for _ in range(repeats + 1):
        before()
        ts.append(_seconds(fn))
    return min(ts[1:])


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_call(fn, repeats: int, reduce=min) -> float:
    """reduce (min, or statistics.median) of the seconds of `repeats` calls of fn, after one
    untimed warm-up call."""
    fn()
    return reduce([_seconds(fn) for _ in range(repeats)])


@dataclass
class CostModel:
    """Seconds for the runtime's primitives at each timed row count (ROWS)."""

    num_layers: int
    attn: dict[int, float]  # one attention sub-layer (norm, qkv, rope, cache write, attention, out)
    mlp: dict[int, float]  # one MLP sub-layer
    head: dict[int, float]  # final norm + full LM head
    draft_heads: dict[int | str, float] = field(default_factory=dict)  # head_key -> a 1-row draft head
    embed: float = 0.0
    step_overhead: float = 0.0  # per forward call beyond its parts (masks, Python), measured
    quant_layers: dict[int, tuple[float, float]] = field(default_factory=dict)  # bits -> 1-row (attention, MLP) of the quantized copy
    head_greedy: dict[int, float] = field(default_factory=dict)  # the head for argmax only (greedy_head.py); empty: as `head`

    def greedy(self) -> "CostModel":
        """These costs for greedy decoding: the head computed for argmax only (where the runtime
        screens it; elsewhere the same costs)."""
        return replace(self, head=self.head_greedy) if self.head_greedy else self

    @classmethod
    def measure(cls, runtime, draft_heads: dict[int | str, object] | None = None, quantized: dict | None = None,
                repeats: int = 5) -> "CostModel":
        """The fastest of `repeats` timings per primitive (other processes only ever add time;
        medians on a busy 2-core machine came out tens of times too high). `draft_heads`:
        head_key -> a head as the runtime multiplies it (prepared or quantized); `quantized`:
        bits -> the quantized copy of the runtime (1-row sub-layers).

        A sub-layer's cost is one pass of all L of them (attention only, then MLP only) over L,
        each pass timed right after the other kind's: a decode step streams every weight from
        memory, and one layer timed alone, again and again, runs from cache wherever it fits
        (Gemma 3 270M: 11 MB a layer, 32 MB of L3): that timed its layers at a small part of a
        step, left the rest as a per-call "overhead" every draft token was charged, and priced
        the int8 draft token at 0.48 of a step where it takes 0.19."""
        cache = runtime.new_cache(256)
        L = runtime.num_layers
        none, every = frozenset(), frozenset(range(L))
        gen = torch.Generator().manual_seed(0)
        H = runtime.spec.hidden_size
        timed = partial(time_call, repeats=repeats)  # min, not median (above)

        def sublayers(rt, h) -> tuple[float, float]:  # (attention, MLP) seconds of one sub-layer, from memory
            ta, tm = time_alternating(lambda: rt.run_layers(h, 0, L, 100, cache, none, every),
                                      lambda: rt.run_layers(h, 0, L, 100, cache, every, none), repeats)
            return ta / L, tm / L

        attn, mlp, head, head_greedy = {}, {}, {}, {}
        with torch.inference_mode():
            for r in ROWS:
                h = (torch.randn(r, H, generator=gen) * 0.1).to(runtime.device, runtime.dtype)
                attn[r], mlp[r] = sublayers(runtime, h)
                head[r] = timed(lambda: runtime.logits(h))
                head_greedy[r] = timed(lambda: runtime.argmax(h))
            h1 = (torch.randn(1, H, generator=gen) * 0.1).to(runtime.device, runtime.dtype)
            flush = lambda: runtime.run_layers(h1, 0, L, 100, cache, every, none)  # noqa: E731 - streams the MLP weights
            # a draft head runs after the draft's layers have streamed: from memory, not from cache
            drafts = {k: time_after(lambda w=w: runtime.logits(h1, head=w), flush, repeats) for k, w in (draft_heads or {}).items()}
            quant = {bits: sublayers(q, h1) for bits, q in (quantized or {}).items()}
            ids = torch.tensor([1], device=runtime.device)
            embed = timed(lambda: runtime.embed(ids))
            # What a whole call costs beyond its parts (masks, Python per call): every
            # draft token and every verify pass is one such call.
            forward = timed(lambda: runtime.forward(ids, 100, cache))
        # More rows never cost less; timing noise (and CPU row padding: 1 row runs as 2)
        # must not make a longer verify look cheaper.
        for table in (attn, mlp, head, head_greedy):
            for a, b in zip(ROWS, ROWS[1:]):
                table[b] = max(table[b], table[a])
        overhead = max(0.0, forward - (embed + L * (attn[1] + mlp[1]) + head[1]))
        head_greedy = {r: min(t, head[r]) for r, t in head_greedy.items()}  # never dearer: it could fall back to the full head
        return cls(L, attn, mlp, head, drafts, embed, overhead, quant, head_greedy)

    def implausible(self) -> str | None:
        """Why these timings cannot be this machine's, else None. Taken on a busy machine (other
        processes only add time, and the kernels' spinning workers lose whole time slices), a
        table can come out tens of times too high in places: one kept on disk from such a moment
        once priced the int8 draft's layers at a hundred times the model's own and auto never drafted. The
        bounds leave a wide margin: r rows cost at most 2r times one row (the same work r times,
        memory-bound: far less at 2 rows in practice), and a quantized sub-layer or a draft head
        at most 4x what the model's own sub-layer or full head costs (they read fewer bytes)."""
        for name, table in (("attention", self.attn), ("MLP", self.mlp), ("head", self.head)):
            one = table.get(1)
            for r, t in table.items():
                if one is not None and t > 2.0 * r * max(one, 1e-7):
                    return f"{name} over {r} rows timed at {t / one:.0f}x one row"
        for bits, (a, m) in self.quant_layers.items():
            if a > 4.0 * self.attn[1] or m > 4.0 * self.mlp[1]:
                return f"an int{bits} sub-layer timed at {max(a / self.attn[1], m / self.mlp[1]):.0f}x the model's own"
        for k, t in self.draft_heads.items():
            if t > 4.0 * self.head[1]:
                return f"draft head {k} timed at {t / self.head[1]:.0f}x the full head"
        return None

    # -- composite costs ------------------------------------------------------------------

    def layers(self, n: int, rows: int = 1) -> float:
        return n * (_interp(self.attn, rows) + _interp(self.mlp, rows))

    def draft_head(self, draft_vocab: int | None, bits: int | None = None) -> float:
        key = head_key(draft_vocab, bits)
        if key is None or key not in self.draft_heads:
            return _interp(self.head, 1)
        return self.draft_heads[key]

    @property
    def ar_step(self) -> float:
        return self.embed + self.layers(self.num_layers) + _interp(self.head, 1) + self.step_overhead

    def verify(self, rows: int) -> float:
        """Full model over `rows` positions (pending token + drafts)."""
        return self.embed + self.layers(self.num_layers, rows) + _interp(self.head, rows) + self.step_overhead

    def draft_token(self, cfg: DraftConfig, adapter_cost: float = 0.0) -> float:
        """Seconds to draft one token with cfg."""
        if cfg.strategy in ("early-exit", "exit-adapter"):
            return self.embed + self.layers(cfg.exit_layer) + self.draft_head(cfg.draft_vocab) + adapter_cost + self.step_overhead
        if cfg.strategy in ("layer-skip", "quantized"):
            E = cfg.exit_layer or self.num_layers
            n_attn = E - sum(1 for i in cfg.skip_attn if i < E)
            n_mlp = E - sum(1 for i in cfg.skip_mlp if i < E)
            a, m = (_interp(self.attn, 1), _interp(self.mlp, 1)) if cfg.strategy == "layer-skip" else self.quant_layers[cfg.draft_bits]
            return self.embed + n_attn * a + n_mlp * m + self.draft_head(*cfg.draft_head()) + self.step_overhead
        return 0.0  # prompt-lookup: a list scan, negligible next to a forward pass

    def verify_step(self, cfg: DraftConfig, drafted: int, exit_cached: bool) -> float:
        """Seconds to verify `drafted` tokens. Early exit reuses the draft's KV for layers < E
        and the exit hidden states: layers E.. run over drafted + 1 rows, and only an input
        the draft never ran (the last draft, when drafting ran to k) still goes through
        layers < E (`exit_cached` False)."""
        if cfg.strategy in ("early-exit", "exit-adapter") and (drafted > 0 or exit_cached):
            E = cfg.exit_layer
            first = 0.0 if exit_cached else self.embed + self.layers(E)
            return first + self.layers(self.num_layers - E, drafted + 1) + _interp(self.head, drafted + 1) + self.step_overhead
        return self.verify(drafted + 1)

    def to_dict(self) -> dict:
        """The one serialised form (the costs file and bench/search reports); ar_step_s is derived."""
        return {
            "num_layers": self.num_layers,
            "attn_s": self.attn, "mlp_s": self.mlp, "head_s": self.head,
            "draft_heads_s": {str(k): v for k, v in self.draft_heads.items()}, "embed_s": self.embed,
            "call_overhead_s": self.step_overhead, "quant_layers_s": {str(b): list(v) for b, v in self.quant_layers.items()},
            "head_greedy_s": self.head_greedy, "ar_step_s": self.ar_step,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        table = lambda t: {int(k): float(v) for k, v in t.items()}  # noqa: E731
        heads = {(int(k) if k.isdigit() else k): float(v) for k, v in d["draft_heads_s"].items()}
        quant = {int(b): (float(v[0]), float(v[1])) for b, v in d.get("quant_layers_s", {}).items()}
        return cls(int(d["num_layers"]), table(d["attn_s"]), table(d["mlp_s"]), table(d["head_s"]),
                   heads, float(d["embed_s"]), float(d["call_overhead_s"]), quant, table(d.get("head_greedy_s", {})))


def costs_path(identity: dict) -> Path:
    """Where costs measured for `identity` are kept: $SELFSPEC_COSTS_DIR when set (the test
    suite points it at a temporary directory, so no run sees another's timings), else
    costs/ under the selfspec cache."""
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return Path(os.environ.get("SELFSPEC_COSTS_DIR") or cache_root() / "costs") / f"{key}.json"


def load_stored(identity: dict, fmt: str) -> dict | None:
    """What save_stored kept for exactly this identity and format, else None."""
    try:
        d = json.loads(costs_path(identity).read_text())
        if d.get("format") != fmt or d.get("identity") != identity or not isinstance(d.get("costs"), dict):
            return None
        return d["costs"]
    except (OSError, ValueError):
        return None


def save_stored(identity: dict, fmt: str, costs: dict) -> None:
    """Keep measured costs (a JSON-able dict) for `identity` (atomically: readers never see half)."""
    d = {"format": fmt, "identity": identity, "costs": costs}
    try:
        atomic_write_text(costs_path(identity), json.dumps(d, indent=1) + "\n")
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time


def load_costs(identity: dict) -> CostModel | None:
    """Costs measured earlier for exactly this identity (model, dtype, device, threads...);
    None also for timings that cannot be right (CostModel.implausible): measured again."""
    d = load_stored(identity, FORMAT)
    try:
        costs = None if d is None else CostModel.from_dict(d)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return None if costs is None or costs.implausible() else costs


def measure_plausibly(measure, attempts: int = 3) -> tuple[CostModel, str | None]:
    """measure() again while its timings are implausible, at most `attempts` times: (the last
    costs, why they are still implausible or None). A busy moment passes; a busy machine keeps
    the last timings for this process only (see resources.cost_model)."""
    for _ in range(attempts):
        costs = measure()
        why = costs.implausible()
        if why is None:
            break
    return costs, why


def save_costs(identity: dict, costs: CostModel) -> None:
    save_stored(identity, FORMAT, costs.to_dict())
