"""Quantized self-drafting: the model drafts with a low-bit copy of its own weights (int8 per
output channel, or int4 groups; selfspec/quant.py, csrc/quant.c), optionally only its first
layers or with sub-layers skipped, over the full or a restricted vocabulary (the head
quantized too). Decoding is bandwidth-bound: the copy reads 2-4x fewer bytes and, at int8,
agrees with the full model on ~98% of next tokens, with no training. The verifier is the
untouched model, so greedy output is exactly plain decoding's and sampling stays exact."""

from __future__ import annotations

from selfspec.drafters.layer_skip import LayerSkipDrafter


class QuantizedDrafter(LayerSkipDrafter):
    """LayerSkipDrafter whose draft runtime is the quantized copy (resources.quantized):
    it shares embeddings, norms and the KV cache layout with the verifier, so it attends to
    the verifier's exact keys and values and no second cache exists."""

    name = "quantized"
