"""Batched self-speculative decoding with continuous batching (engine.py documents a step).

    sequence.py   BatchRequest, BatchHandle, the per-sequence state and how it drafts
    planner.py    per-step draft lengths that maximise the batch's tokens per second
    passes.py     batched draft forwards and the one staged verify + prefill pass
    engine.py     BatchEngine: submit / cancel / step
"""

from selfspec.batch.engine import BatchEngine
from selfspec.batch.planner import BatchCosts
from selfspec.batch.sequence import BatchHandle, BatchRequest

__all__ = ["BatchCosts", "BatchEngine", "BatchHandle", "BatchRequest"]
