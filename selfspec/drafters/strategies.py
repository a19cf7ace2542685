"""The built-in strategies' registry entries (strategies.py): what each reads, needs and
builds, and how the batch engine drives it. The drafters package imports this module, so they
are registered with the package."""

from __future__ import annotations

from selfspec.config import DraftConfig
from selfspec.drafters.base import Drafter
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.early_exit import EarlyExitDrafter, ExitAdapterDrafter
from selfspec.drafters.factory import build_auto, draft_over
from selfspec.drafters.layer_skip import LayerSkipDrafter
from selfspec.drafters.lookup import PromptLookupDrafter
from selfspec.drafters.quantized import QuantizedDrafter
from selfspec.resources import DraftResources
from selfspec.strategies import Strategy, register

_SELF = ("num_speculations", "draft_threshold", "adaptive", "draft_vocab", "lookup_first")  # every self-drafter's


def _early_exit(cfg: DraftConfig, res: DraftResources, eos_ids: tuple[int, ...], vocab: bool) -> Drafter:
    d = EarlyExitDrafter(res.runtime, cfg, eos_ids)
    draft_over(d, res, cfg.draft_vocab if vocab else None)
    return d


def _layer_skip(cfg: DraftConfig, res: DraftResources, eos_ids: tuple[int, ...], vocab: bool) -> Drafter:
    d = LayerSkipDrafter(res.runtime, cfg, eos_ids)
    draft_over(d, res, cfg.draft_vocab if vocab else None)
    return d


def _exit_adapter(cfg: DraftConfig, res: DraftResources, eos_ids: tuple[int, ...], vocab: bool) -> Drafter:
    adapter, weights = res.adapter(cfg.adapter, cfg.exit_layer)
    d = ExitAdapterDrafter(res.runtime, cfg.replace(exit_layer=adapter.meta.exit_layer), eos_ids, adapter, weights)
    draft_over(d, res, cfg.draft_vocab if vocab else None)
    return d


def _quantized(cfg: DraftConfig, res: DraftResources, eos_ids: tuple[int, ...], vocab: bool) -> Drafter:
    d = QuantizedDrafter(res.runtime, cfg, eos_ids, draft_rt=res.quantized(cfg.draft_bits))
    draft_over(d, res, cfg.draft_vocab if vocab else None, cfg.head_bits, always=True)  # the head quantized too
    return d


def _draft_model(cfg: DraftConfig, res: DraftResources, eos_ids: tuple[int, ...], vocab: bool) -> Drafter:
    d = DraftModelDrafter(res.runtime, cfg, eos_ids, res.draft_model(cfg.draft_model))
    if cfg.draft_vocab is not None and vocab:  # restricts the draft model's own logits
        d.set_draft_vocab(res.draft_vocabulary(cfg.draft_vocab))
    return d


for _entry in (
    Strategy("autoregressive", frozenset(), lambda cfg, res, eos_ids, vocab: Drafter(res.runtime, cfg, eos_ids),
             batching="plain"),
    Strategy("early-exit", frozenset(("exit_layer", *_SELF)), _early_exit, required=("exit_layer",), batching="depth",
             self_drafting=True, exit_states=True),
    Strategy("layer-skip", frozenset(("skip_attn", "skip_mlp", *_SELF)), _layer_skip, required=("skip_attn", "skip_mlp"),
             batching="depth", self_drafting=True),
    Strategy("exit-adapter", frozenset(("adapter", "exit_layer", *_SELF)), _exit_adapter, required=("adapter",),
             self_drafting=True),
    Strategy("quantized", frozenset(("draft_bits", "head_bits", "exit_layer", "skip_attn", "skip_mlp", *_SELF)), _quantized,
             batching="depth", self_drafting=True, checks_guesses=True, needs_kernels=True),
    Strategy("draft-model", frozenset(("draft_model", "num_speculations", "draft_threshold", "adaptive", "draft_vocab")),
             _draft_model, required=("draft_model",)),
    Strategy("prompt-lookup", frozenset(("num_speculations", "max_ngram")),
             lambda cfg, res, eos_ids, vocab: PromptLookupDrafter(res.runtime, cfg, eos_ids), batching="free"),
    # auto: the draft vocabulary and lookup n-gram of the draft calibration picks, or a base to gate
    Strategy("auto", frozenset(("draft_vocab", "max_ngram", "base")), lambda cfg, res, eos_ids, vocab: build_auto(cfg, res, eos_ids)),
):
    register(_entry)
