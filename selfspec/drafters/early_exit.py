"""Early exit (LayerSkip) and exit adapters (Kangaroo): draft from the hidden state leaving
layer E-1, reusing everything the draft computed when verifying.

The family's contract, for subclasses (exit adapters use all three):
  _head_input(h, pos)     what the head drafts from, for exit hidden states h [T, H] at pos..
  _exits_written(h, pos)  exit hidden states at pos.. were computed outside drafting (the
                          last draft, drafts from elsewhere, the prompt)
  _catch_up(step)         context this drafter has not seen (a prefill it did not run)
"""

from __future__ import annotations

import torch

from selfspec import kernels
from selfspec.adapter import AdapterCache, AdapterWeights, prepared_weights
from selfspec.cache import KVCache
from selfspec.drafters.base import Draft, Step
from selfspec.drafters.tokenwise import TokenDrafter


class EarlyExitDrafter(TokenDrafter):
    """LayerSkip: draft with layers 0..E-1 + the model's own final norm and head. The draft
    writes the KV of layers < E for every drafted input, and keeps the hidden state leaving
    layer E-1 (the exit-query cache); verification then runs only the last draft through
    layers < E and all k+1 positions through layers E..L-1."""

    name = "early-exit"

    def __init__(self, runtime, cfg, eos_ids=()):
        super().__init__(runtime, cfg, eos_ids)
        self.exit = cfg.exit_layer
        self._exit_h: list[torch.Tensor] = []

    def depth_signature(self) -> tuple:
        """What it drafts with (batch/passes.signature): its runtime to the exit, its draft head."""
        return (self.rt, self.exit, self.draft_head, frozenset(), frozenset())

    def _exit_hidden(self, tokens, pos: int, cache: KVCache) -> torch.Tensor:
        """Layers 0..E-1 over tokens (ids) at positions pos.. (their KV written): -> [T, H]."""
        ids = torch.as_tensor(tokens, device=self.rt.device)
        return self.rt.run_layers(self.rt.embed(ids), 0, self.exit, pos, cache)

    def draft(self, step: Step) -> Draft:
        d = Draft()
        self._exit_h = []
        token = step.tokens[-1]
        for j in range(step.k):
            h = self._exit_hidden([token], step.pos + j, step.cache)  # [1, H]
            self._exit_h.append(h)
            if not self._choose(self.rt.logits(self._head_input(h, step.pos + j), head=self.draft_head)[0], step, d):
                break
            token = d.tokens[-1]
        return d

    def _head_input(self, h: torch.Tensor, pos: int) -> torch.Tensor:
        return h

    def verify(self, step: Step, draft: Draft) -> torch.Tensor | list[int]:
        inputs = [step.tokens[-1], *draft.tokens]
        j = len(self._exit_h)
        if j < len(inputs):  # inputs not yet through layers < E: the last draft, or drafts from elsewhere
            self._exit_h.append(self._exit_hidden(inputs[j:], step.pos + j, step.cache))
            self._exits_written(self._exit_h[-1], step.pos + j)
        h = torch.cat(self._exit_h)  # [k+1, H]
        h = self.rt.run_layers(h, self.exit, self.rt.num_layers, step.pos, step.cache)
        return self.rt.head_output(h, step.argmax_only, step.picks_only)

    def _exits_written(self, h: torch.Tensor, pos: int) -> None:
        pass

    def verify_foreign(self, step: Step, draft: Draft) -> torch.Tensor:
        """The same pass as verify, through the exit, so per-position state stays complete."""
        self._exit_h = []
        return self.verify(step, draft)


class ExitAdapterDrafter(EarlyExitDrafter):
    """Kangaroo-style: early exit with a small trained block between layer E-1 and the head
    (selfspec/adapter.py). Everything else, the shared KV and the exit-query cache included,
    is early exit's; the exit-query cache keeps the *un*adapted hidden states, which are what
    layer E of the full model consumes. An adapter with attention also keeps its own keys
    and values per position (AdapterCache), written wherever exit hidden states are made:
    the prompt, every draft input, the inputs verification runs through layers < E."""

    name = "exit-adapter"

    def __init__(self, runtime, cfg, eos_ids=(), adapter=None, weights: AdapterWeights | None = None):
        super().__init__(runtime, cfg, eos_ids)
        self.adapter = adapter
        # the block's matrices as the runtime multiplies them (resources.adapter prepares them once)
        self._weights = weights if weights is not None else prepared_weights(adapter, runtime)
        self._matmul = kernels.matmul if runtime.uses_kernels else torch.matmul
        self._kv: AdapterCache | None = None
        self._kv_len = 0  # positions 0.._kv_len-1 have adapter keys/values

    @property
    def attends(self) -> bool:
        return self.adapter.meta.heads > 0

    def start(self, cache):
        super().start(cache)
        if self.attends:
            self._kv = AdapterCache(self.adapter.meta, cache.capacity, self.rt.device)
            self._kv_len = 0

    def prefill(self, ids, cache, argmax_only=False):
        if not self.attends:
            return super().prefill(ids, cache, argmax_only)
        self.start(cache)
        h = self._exit_hidden(ids, 0, cache)  # [P, H]
        self._exits_written(h, 0)
        h = self.rt.run_layers(h, self.exit, self.rt.num_layers, 0, cache)
        return (self.rt.argmax if argmax_only else self.rt.logits)(h[-1:])[0]

    def _catch_up(self, step: Step) -> None:
        """Context this drafter has not seen (a prefill it did not run, e.g. auto's
        calibration pass): its exit hidden states again, for the adapter's keys/values.
        Layers < E rewrite identical KV: every row is computed on its own."""
        if self.attends and self._kv_len < step.pos:
            self._exits_written(self._exit_hidden(step.tokens[self._kv_len : step.pos], self._kv_len, step.cache), self._kv_len)

    def draft(self, step):
        self._catch_up(step)
        return super().draft(step)

    def verify_foreign(self, step, draft):
        self._catch_up(step)
        return super().verify_foreign(step, draft)

    def _exits_written(self, h, pos):
        if self.attends:
            self._head_input(h, pos)

    def _head_input(self, h, pos):
        out = self.adapter.block(h, self._weights, self._matmul, pos, self._kv)
        if self.attends and pos <= self._kv_len:  # the cache stays gap-free from position 0
            self._kv_len = max(self._kv_len, pos + h.shape[0])
        return out
