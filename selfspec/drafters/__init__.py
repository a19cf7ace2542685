"""Draft strategies (base.py documents the protocol with the engine).

    base.py          Step, Draft, Drafter (the protocol; autoregressive)
    tokenwise.py     TokenDrafter: token-by-token drafting, thresholds, restricted vocabularies
    early_exit.py    early exit (LayerSkip) and exit adapters (Kangaroo)
    layer_skip.py    skipped sub-layers (Draft & Verify)
    quantized.py     a low-bit copy of the model's own weights
    lookup.py        prompt lookup;  lookup_first.py: lookup, else a self-drafter
    draft_model.py   a separate, smaller model
    auto.py          the default: gates a draft by its predicted speedup
    factory.py       build(cfg, resources): a generation's drafter
    strategies.py    the built-in strategies' registry entries (selfspec/strategies.py)
"""

from selfspec.drafters.auto import AutoDrafter
from selfspec.drafters.base import Draft, Drafter, Step
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.early_exit import EarlyExitDrafter, ExitAdapterDrafter
from selfspec.drafters.factory import build, build_auto, costs_for, make_drafter
from selfspec.drafters.layer_skip import LayerSkipDrafter
from selfspec.drafters.lookup import PromptLookupDrafter
from selfspec.drafters.lookup_first import LookupFirstDrafter
from selfspec.drafters.quantized import QuantizedDrafter
from selfspec.drafters import strategies as _builtin  # noqa: F401  (registers the built-in strategies)
from selfspec.drafters.tokenwise import AdaptiveThreshold, TokenDrafter

__all__ = ["AdaptiveThreshold", "AutoDrafter", "Draft", "DraftModelDrafter", "Drafter", "EarlyExitDrafter",
           "ExitAdapterDrafter", "LayerSkipDrafter", "LookupFirstDrafter", "PromptLookupDrafter", "QuantizedDrafter",
           "Step", "TokenDrafter", "build", "build_auto", "costs_for", "make_drafter"]
