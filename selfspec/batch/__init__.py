"""Batched self-speculative decoding with continuous batching (engine.py documents a step).

    sequence.py   BatchHandle, the per-sequence state and how it drafts (a request: request.py)
    planner.py    per-step draft lengths that maximise the batch's tokens per second
    passes.py     batched draft forwards and the one staged verify + prefill pass
    engine.py     BatchEngine: submit / cancel / step
"""

from selfspec.batch.engine import BatchEngine
from selfspec.batch.planner import BatchCosts
from selfspec.batch.sequence import BatchHandle, BatchRequest
from selfspec.request import Request

__all__ = ["BatchCosts", "BatchEngine", "BatchHandle", "BatchRequest", "Request"]
