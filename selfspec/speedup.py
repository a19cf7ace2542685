"""Predicting a draft configuration's speedup from measured costs and measured acceptance.

Leviathan et al.: with acceptance alpha per draft token and k drafts per verify step,

    E[N] = (1 - alpha^(k+1)) / (1 - alpha)          tokens per verify step
    S    = E[N] * t_ar / (k * t_draft + t_verify)   speedup over autoregressive

Here both sides come from measurement on the model at hand, not from the formula's
i.i.d. assumption:
  * `CostModel` times the runtime's primitives (one attention / MLP sub-layer and the LM
    head at each row count a step uses) on a scratch cache, so `t_draft` and `t_verify` of
    any strategy are sums of measured parts (this is what makes a search trial cheap);
  * `simulate` replays greedy speculative decoding over a *teacher-forced* sequence: for
    greedy decoding of a sequence the target itself produced, draft j of a step sees exactly
    the tokens the real run would (accepted drafts equal the target's tokens), so walking
    the sequence with the per-position agreement array reproduces the real run's accepted
    lengths step by step. Only the costs are modelled.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from selfspec.config import MAX_SPECULATIONS, DraftConfig

ROWS = (1, 2, 3, 5, 9, MAX_SPECULATIONS + 1)  # row counts timed; others interpolate


def expected_tokens(alpha: float, k: int) -> float:
    """E[N] for i.i.d. acceptance alpha and k drafts (the verifier's token included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _interp(table: dict[int, float], rows: int) -> float:
    xs = sorted(table)
    return float(np.interp(rows, xs, [table[x] for x in xs]))


@dataclass
class CostModel:
    """Seconds for the runtime's primitives at each timed row count (ROWS)."""

    num_layers: int
    attn: dict[int, float]  # one attention sub-layer (norm, qkv, rope, cache write, attention, out)
    mlp: dict[int, float]  # one MLP sub-layer
    head: dict[int, float]  # final norm + full LM head
    draft_heads: dict[int, float] = field(default_factory=dict)  # draft vocab N -> 1-row restricted head
    embed: float = 0.0
    step_overhead: float = 0.0  # per forward call beyond its parts (masks, Python), measured

    @classmethod
    def measure(cls, runtime, draft_vocabs: dict[int, object] | None = None, repeats: int = 5, layers: int = 3) -> "CostModel":
        """Median of `repeats` timings per primitive, averaged over `layers` evenly spaced
        layers. `draft_vocabs`: N -> prepared restricted head (runtime.prepare_weight)."""
        clock = time.perf_counter
        cache = runtime.new_cache(256)
        L = runtime.num_layers
        probe_layers = sorted({round(i * (L - 1) / max(layers - 1, 1)) for i in range(layers)})
        all_layers = frozenset(range(L))
        gen = torch.Generator().manual_seed(0)
        H = runtime.spec.hidden_size

        def timed(fn) -> float:
            fn()  # warm-up
            ts = []
            for _ in range(repeats):
                t0 = clock()
                fn()
                ts.append(clock() - t0)
            return statistics.median(ts)

        attn, mlp, head = {}, {}, {}
        with torch.inference_mode():
            for r in ROWS:
                h = (torch.randn(r, H, generator=gen) * 0.1).to(runtime.device, runtime.dtype)
                masks = runtime.masks(100, r, cache)
                ta, tm = [], []
                for i in probe_layers:
                    ta.append(timed(lambda: runtime.run_layers(h, i, i + 1, 100, cache, frozenset(), all_layers, masks)))
                    tm.append(timed(lambda: runtime.run_layers(h, i, i + 1, 100, cache, all_layers, frozenset(), masks)))
                attn[r], mlp[r] = statistics.mean(ta), statistics.mean(tm)
                head[r] = timed(lambda: runtime.logits(h))
            h1 = (torch.randn(1, H, generator=gen) * 0.1).to(runtime.device, runtime.dtype)
            drafts = {n: timed(lambda w=w: runtime.logits(h1, head=w)) for n, w in (draft_vocabs or {}).items()}
            ids = torch.tensor([1], device=runtime.device)
            embed = timed(lambda: runtime.embed(ids))
            # What a whole call costs beyond its parts (masks, Python per call): every
            # draft token and every verify pass is one such call.
            forward = timed(lambda: runtime.forward(ids, 100, cache))
        # More rows never cost less; timing noise (and CPU row padding: 1 row runs as 2)
        # must not make a longer verify look cheaper.
        for table in (attn, mlp, head):
            for a, b in zip(ROWS, ROWS[1:]):
                table[b] = max(table[b], table[a])
        overhead = max(0.0, forward - (embed + L * (attn[1] + mlp[1]) + head[1]))
        return cls(L, attn, mlp, head, drafts, embed, overhead)

    # -- composite costs ------------------------------------------------------------------

    def layers(self, n: int, rows: int = 1) -> float:
        return n * (_interp(self.attn, rows) + _interp(self.mlp, rows))

    def draft_head(self, draft_vocab: int | None) -> float:
        if draft_vocab is None or draft_vocab not in self.draft_heads:
            return _interp(self.head, 1)
        return self.draft_heads[draft_vocab]

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
        if cfg.strategy == "layer-skip":
            n_attn = self.num_layers - len(cfg.skip_attn)
            n_mlp = self.num_layers - len(cfg.skip_mlp)
            return (self.embed + n_attn * _interp(self.attn, 1) + n_mlp * _interp(self.mlp, 1) + self.draft_head(cfg.draft_vocab)
                    + self.step_overhead)
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
        return {
            "num_layers": self.num_layers,
            "attn_s": self.attn, "mlp_s": self.mlp, "head_s": self.head,
            "draft_heads_s": self.draft_heads, "embed_s": self.embed, "call_overhead_s": self.step_overhead,
            "ar_step_s": self.ar_step,
        }


def _costs_path(identity: dict):
    """Where costs measured for `identity` are kept: $SELFSPEC_COSTS_DIR when set (the test
    suite points it at a temporary directory, so no run sees another's timings), else
    costs/ under the selfspec cache."""
    import hashlib
    import json
    import os
    from pathlib import Path

    from selfspec.loading import cache_root

    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return Path(os.environ.get("SELFSPEC_COSTS_DIR") or cache_root() / "costs") / f"{key}.json"


def load_costs(identity: dict) -> CostModel | None:
    """Costs measured earlier for exactly this identity (model, dtype, device, threads...)."""
    import json

    try:
        d = json.loads(_costs_path(identity).read_text())
        if d.get("identity") != identity:
            return None
        table = lambda t: {int(k): float(v) for k, v in t.items()}  # noqa: E731
        return CostModel(int(d["num_layers"]), table(d["attn"]), table(d["mlp"]), table(d["head"]),
                         table(d["draft_heads"]), float(d["embed"]), float(d["step_overhead"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_costs(identity: dict, costs: CostModel) -> None:
    import json

    from selfspec.profiles import atomic_write_text

    d = {"identity": identity, "num_layers": costs.num_layers, "attn": costs.attn, "mlp": costs.mlp, "head": costs.head,
         "draft_heads": costs.draft_heads, "embed": costs.embed, "step_overhead": costs.step_overhead}
    try:
        atomic_write_text(_costs_path(identity), json.dumps(d, indent=1) + "\n")
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time


@dataclass
class Calibration:
    """Teacher-forced signals for one token sequence (positions where drafting is scored).

    match[t]: the draft made from position t's hidden state equals the target's greedy token
    at t; conf[t]: the draft's top-1 probability there (for threshold drafting)."""

    match: np.ndarray  # bool [T]
    conf: np.ndarray  # float [T]


@dataclass
class Prediction:
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    time_s: float = 0.0  # modelled seconds for the walk
    ar_time_s: float = 0.0  # modelled seconds for the same tokens autoregressively

    @property
    def speedup(self) -> float:
        return self.ar_time_s / self.time_s if self.time_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def step(self, drafted: int, accepted: int, seconds: float) -> int:
        """Record one verify step; -> tokens it commits (accepted drafts + the verifier's)."""
        self.time_s += seconds
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.tokens += accepted + 1
        return accepted + 1

    def add(self, other: "Prediction") -> "Prediction":
        return Prediction(*(getattr(self, f) + getattr(other, f) for f in ("tokens", "steps", "drafted", "accepted", "time_s", "ar_time_s")))

    def to_dict(self) -> dict:
        return {
            "predicted_speedup": self.speedup,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens": self.tokens,
            "verify_steps": self.steps,
        }


def simulate(cfg: DraftConfig, cal: Calibration, costs: CostModel, adapter_cost: float = 0.0,
             tokens: list[int] | None = None, start: int = 0) -> Prediction:
    """Walk greedy speculative decoding over a teacher-forced sequence (see module doc).

    Position t of `cal` is a pending token whose successor is the target's token t+1; a
    step at pending position p drafts from p, p+1, ... (draft j is right iff match[p+j])
    while j < k and, with a threshold, the draft's confidence is high enough; it accepts
    the leading matches and commits accepted + 1 tokens, like the engine (k is capped so
    a step never commits past the end). With cfg.lookup_first, `tokens` is the whole
    sequence and position t of `cal` is tokens[start + t]: a prompt-lookup match, when there
    is one, is drafted instead and verified by a full pass."""
    from selfspec.drafters import lookup_continuation

    T, K = len(cal.match), cfg.num_speculations
    gamma = cfg.draft_threshold
    t_draft = costs.draft_token(cfg, adapter_cost)
    out = Prediction()
    p = 0
    while p < T:
        k = min(K, T - p - 1)
        if cfg.lookup_first and k > 0:
            q = start + p  # absolute index of the pending token
            draft = lookup_continuation(tokens[: q + 1], cfg.max_ngram, k)
            if draft:
                p += out.step(len(draft), _matching_prefix(draft, tokens, q + 1), costs.verify(len(draft) + 1))
                continue
        drafted, stopped = 0, False
        while drafted < k:
            if gamma is not None and cal.conf[p + drafted] < gamma:
                stopped = True  # this position still ran through the draft: its confidence was read
                break
            drafted += 1
        n = 0
        while n < drafted and cal.match[p + n]:
            n += 1
        p += out.step(drafted, n, (drafted + stopped) * t_draft + costs.verify_step(cfg, drafted, exit_cached=stopped))
    out.ar_time_s = out.tokens * costs.ar_step
    return out


def _matching_prefix(draft: list[int], tokens: list[int], at: int) -> int:
    """How many leading draft tokens equal tokens[at:] (greedy acceptance)."""
    n = 0
    while n < len(draft) and draft[n] == tokens[at + n]:
        n += 1
    return n


def simulate_lookup(cfg: DraftConfig, tokens: list[int], start: int, costs: CostModel) -> Prediction:
    """Prompt lookup over a greedy sequence: tokens[:start] is the prompt and tokens[start:]
    the target's own continuation (tokens[start] came from the prefill). Drafts come from
    the context exactly as at run time, so the walk is the real run's."""
    from selfspec.drafters import lookup_continuation

    out = Prediction()
    p, end = start, len(tokens) - 1  # p: index of the pending token
    while p < end:
        k = min(cfg.num_speculations, end - p - 1)
        draft = lookup_continuation(tokens[: p + 1], cfg.max_ngram, k) if k > 0 else []
        p += out.step(len(draft), _matching_prefix(draft, tokens, p + 1), costs.verify(len(draft) + 1))
    out.ar_time_s = out.tokens * costs.ar_step
    return out


# -- measured acceptance ------------------------------------------------------------------


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


def teacher_forced(runtime, ids: list[int], score_from: int = 0, exits=(), skip_sets=(), draft_head=None,
                   vocab: torch.Tensor | None = None, adapters: dict | None = None) -> dict:
    """One full forward over ids, scoring positions score_from.. against the full model's
    greedy token. Returns {"target": [T'], ("exit", E): Calibration, ("skip", a, m): ...,
    ("adapter", E): ...}.

    Exits reuse the full pass's hidden states (layers < E are the same computation). Skip
    sets run their own teacher-forced pass, which sees draft-computed KV for earlier
    positions where the real run sees the full model's: an approximation, confirmed later
    by measurement."""
    out: dict = {}
    L = runtime.num_layers
    with torch.inference_mode():
        x = torch.tensor(ids, device=runtime.device)
        cache = runtime.new_cache(len(ids))
        h = runtime.embed(x)
        masks = runtime.masks(0, len(ids), cache)
        hidden = {}
        wanted = set(exits) | set((adapters or {}).keys())
        for i in range(L):
            if i in wanted:
                hidden[i] = h[score_from:]
            h = runtime.run_layers(h, i, i + 1, 0, cache, masks=masks)
        target, _ = _argmax_conf(runtime, h[score_from:])
        out["target"] = target
        for E in exits:
            tok, conf = _argmax_conf(runtime, hidden[E], draft_head, vocab)
            out[("exit", E)] = Calibration(tok == target, conf)
        for E, adapter in (adapters or {}).items():
            tok, conf = _argmax_conf(runtime, adapter(hidden[E]), draft_head, vocab)
            out[("adapter", E)] = Calibration(tok == target, conf)
        for skip_a, skip_m in skip_sets:
            cache = runtime.new_cache(len(ids))
            hs = runtime.run_layers(runtime.embed(x), 0, L, 0, cache, frozenset(skip_a), frozenset(skip_m), masks)
            tok, conf = _argmax_conf(runtime, hs[score_from:], draft_head, vocab)
            out[("skip", tuple(skip_a), tuple(skip_m))] = Calibration(tok == target, conf)
    return out


CALIBRATION_POSITIONS = 32  # last prompt positions scored by auto's calibration
CALIBRATION_EXITS = 8  # exit layers scored (evenly spaced)
CALIBRATION_MAX_K = 8
CALIBRATION_PROXY_TOP = 64  # full-vocabulary drafts are scored over the full model's top-64 per position
AUTO_DRAFT_VOCAB = 16384  # auto's draft vocabulary on models with more than 2x this many tokens


def calibration_exits(num_layers: int) -> tuple[int, ...]:
    n = min(CALIBRATION_EXITS, num_layers - 1)
    return tuple(sorted({round(1 + i * (num_layers - 2) / max(n - 1, 1)) for i in range(n)}))


def prefill_capturing(runtime, ids: torch.Tensor, cache, exits) -> tuple[torch.Tensor, dict]:
    """The prompt's prefill, layer by layer (the same operations as Runtime.forward, so the
    cache and logits are bit-identical), keeping the last CALIBRATION_POSITIONS hidden states
    at the input of each exit layer and after the last layer. -> (logits [V], captured)."""
    P = CALIBRATION_POSITIONS
    h = runtime.embed(ids)
    masks = runtime.masks(0, ids.shape[0], cache)
    captured = {}
    for i in range(runtime.num_layers):
        if i in exits:
            captured[i] = h[-P:]
        h = runtime.run_layers(h, i, i + 1, 0, cache, masks=masks)
    captured["final"] = h[-P:]
    return runtime.logits(h[-1:])[0], captured


def calibrate(runtime, ids: list[int], costs: CostModel, auto_cfg: DraftConfig, captured: dict,
              head=None, vocab: torch.Tensor | None = None, draft_vocab: int | None = None) -> tuple[DraftConfig, Prediction | None]:
    """auto without a profile: score early exit at the captured exits and prompt lookup on
    the prompt itself; pick the configuration with the best predicted speedup, prompt
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
    target = target.cpu().numpy()
    candidates: list[tuple[DraftConfig, Prediction]] = []
    for E in sorted(k for k in captured if k != "final"):
        tok, conf = _argmax_conf(runtime, captured[E], head, vocab)
        cal = Calibration(tok == target, conf)
        for k in range(1, CALIBRATION_MAX_K + 1):
            for lookup_first in (False, True):
                cfg = DraftConfig("early-exit", exit_layer=E, num_speculations=k, draft_vocab=draft_vocab,
                                  lookup_first=lookup_first, max_ngram=auto_cfg.max_ngram)
                candidates.append((cfg, simulate(cfg, cal, costs, tokens=ids, start=len(ids) - len(cal.match))))
    top_cfg, top = max(candidates, key=lambda c: c[1].speedup)
    # Near ties go to the longer draft at the same exit: fixed per-step costs the model
    # leaves out (the engine's bookkeeping) favour fewer, longer steps (AutoDrafter._best_k).
    top_cfg, _ = max((c for c in candidates if c[0].exit_layer == top_cfg.exit_layer and c[0].lookup_first == top_cfg.lookup_first
                      and c[1].speedup >= top.speedup * 0.97),
                     key=lambda c: c[0].num_speculations)
    if top.speedup > best.speedup * 1.02:  # near ties go to the free lookup
        best_cfg, best = top_cfg, top
    return best_cfg, best
