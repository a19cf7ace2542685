"""The predicted objective: a draft configuration's speedup, replayed over the model's own greedy
continuations of calibration prompts (Calibration) with measured primitive costs. The search
(search/) ranks its trials with it, and the core ranks a bare strategy's options (options.py);
a trial's measured speedup in timed generations is search/objective.measure."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.predictor.calibrate import teacher_forced
from selfspec.predictor.costs import CostModel
from selfspec.predictor.simulate import Prediction, simulate, simulate_lookup


@dataclass
class Sequence:
    prompt: str
    ids: list[int]  # prompt + greedy continuation
    start: int  # len(prompt ids): ids[start:] is the model's own continuation


class Calibration:
    """Greedy continuations of the calibration prompts and the signals trials read, computed
    lazily and memoised (an exit layer's hidden states serve every K / threshold / vocab)."""

    def __init__(self, model, prompts: list, max_new_tokens: int, strategy: str | None = None):
        """prompts: texts or token ids; strategy: how the continuations are generated (None:
        the default; greedy output is the same whichever)."""
        if not prompts:
            raise SelfSpecError("the calibration set is empty")
        self.model = model
        self.seqs: list[Sequence] = []
        for p in prompts:
            ids = model.encode(p)
            out = model.generate(ids, max_new_tokens=max_new_tokens, strategy=strategy)
            if len(out.token_ids) >= 2:  # a draft scores against the token after the one pending
                self.seqs.append(Sequence(p, ids + out.token_ids, len(ids)))
        if not self.seqs:
            raise SelfSpecError("the model ends every calibration text within one token (an immediate end of "
                                "sequence?): nothing to calibrate on")
        self._signals: dict = {}
        self._heads: dict = {}

    def head(self, draft_vocab: int | None, bits: int | None = None):
        """(head, vocab) of a draft over the draft_vocab most frequent tokens (None: all),
        quantized to `bits` (None: as the runtime multiplies it); held for the whole search."""
        if draft_vocab is None and bits is None:
            return None, None
        if (draft_vocab, bits) not in self._heads:
            vocab, head = self.model.resources.draft_head(draft_vocab, bits)
            self._heads[draft_vocab, bits] = (head, vocab)
        return self._heads[draft_vocab, bits]

    def signals(self, kind: tuple, draft_vocab: int | None, adapter=None, head_bits: int | None = None) -> list:
        """Per sequence, the Agreement of drafts `kind` (("exit", E) | ("skip", a, m) |
        ("adapter", E) | ("quant", bits, E, a, m)) over the continuation positions (the last
        prompt token onward)."""
        key = (kind, draft_vocab, head_bits)
        if key not in self._signals:
            head, vocab = self.head(draft_vocab, head_bits)
            out = []
            for s in self.seqs:
                kw: dict = {}
                if kind[0] == "exit":
                    kw["exits"] = [kind[1]]
                elif kind[0] == "skip":
                    kw["skip_sets"] = [(kind[1], kind[2])]
                elif kind[0] == "quant":
                    kw["drafts"] = {kind: (self.model.resources.quantized(kind[1]), *kind[2:])}
                else:
                    kw["adapters"] = {kind[1]: adapter}
                # Scored positions: ids[start] (the prefill's token, pending at the first
                # step) onward; the last token is left out, its successor is unknown.
                sig = teacher_forced(self.model.runtime, s.ids[:-1], s.start, draft_head=head, vocab=vocab, **kw)
                out.append(sig[kind])
            if len(self._signals) > 256:  # skip sets are rarely revisited: bound the memo
                self._signals.clear()
            self._signals[key] = out
        return self._signals[key]


def predict(cfg: DraftConfig, cal: Calibration, costs: CostModel, adapter=None, adapter_cost: float = 0.0) -> Prediction:
    """Predicted totals of cfg over the calibration sequences."""
    total = Prediction()
    if cfg.strategy == "prompt-lookup":
        for s in cal.seqs:
            # The engine's first step has the first generated token pending.
            total = total.add(simulate_lookup(cfg, s.ids, s.start, costs))
        return total
    if cfg.strategy == "early-exit":
        kind = ("exit", cfg.exit_layer)
    elif cfg.strategy == "exit-adapter":
        kind = ("adapter", cfg.exit_layer)
    elif cfg.strategy == "quantized":
        kind = ("quant", cfg.draft_bits, cfg.exit_layer or cal.model.spec.num_layers, cfg.skip_attn, cfg.skip_mlp)
    else:
        kind = ("skip", cfg.skip_attn, cfg.skip_mlp)
    draft_vocab, head_bits = cfg.draft_head()
    for s, sig in zip(cal.seqs, cal.signals(kind, draft_vocab, adapter, head_bits)):
        total = total.add(simulate(cfg, sig, costs, adapter_cost, tokens=s.ids, start=s.start))
    return total
