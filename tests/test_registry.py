"""The strategy registry (selfspec/strategies.py): a strategy added from one module, its drafter
and one entry, drafts through generate and generate_batch, losslessly, and nothing else had to
change; the built-in entries agree with what the library asks of them."""

from __future__ import annotations

import pytest

from helpers import build_hf, prompts

import selfspec
from selfspec import strategies
from selfspec.config import DraftConfig
from selfspec.drafters.base import Draft, Drafter, Step
from selfspec.errors import SelfSpecError
from selfspec.sampling import PointMass
from selfspec.strategies import Strategy, register


# ---- the toy strategy's module: a drafter and one entry --------------------------------------

class RepeatDrafter(Drafter):
    """Drafts the pending token again, k times: wrong often, never costly, and any draft must
    leave the output as plain decoding's."""

    name = "repeat"

    def draft(self, step: Step) -> Draft:
        tokens = [step.tokens[-1]] * step.k
        return Draft(tokens, [] if step.sampling.greedy else [PointMass(t) for t in tokens])


def toy_entry(name: str, batching: str) -> Strategy:
    return Strategy(name, frozenset(("num_speculations",)),
                    lambda cfg, res, eos_ids, vocab: RepeatDrafter(res.runtime, cfg, eos_ids), batching=batching)


# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return selfspec.load(build_hf("llama", seed=2), dtype="float32")


@pytest.fixture(params=["free", "solo"])
def toy(request):
    name = f"repeat-{request.param}"
    register(toy_entry(name, request.param))
    yield name
    strategies.unregister(name)


SAMPLINGS = [dict(), dict(temperature=0.9, seed=3), dict(temperature=0.8, top_k=20, seed=4)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "gumbel", "gumbel-topk"])
def test_a_registered_strategy_is_lossless(model, toy, sampling):
    ps = prompts(n=3, seed=5)
    plain = [model.generate(p, max_new_tokens=20, strategy="autoregressive", **sampling).token_ids for p in ps]
    solo = [model.generate(p, max_new_tokens=20, strategy=toy, num_speculations=3, **sampling) for p in ps]
    assert [r.token_ids for r in solo] == plain
    assert sum(r.stats.drafted for r in solo) > 0  # it drafted
    kw = dict(sampling, seed=[sampling["seed"]] * len(ps)) if "seed" in sampling else sampling
    batch = model.generate_batch(ps, max_new_tokens=20, strategy=toy, num_speculations=3, max_batch=3, **kw)
    assert [r.token_ids for r in batch] == plain


def test_a_registered_strategy_with_rejection_reproduces_its_seed(model, toy):
    ps = prompts(n=2, seed=6)
    kw = dict(max_new_tokens=20, strategy=toy, temperature=1.0, coupling="rejection")
    solo = [model.generate(p, seed=7, **kw).token_ids for p in ps]
    assert [r.token_ids for r in model.generate_batch(ps, seed=[7, 7], **kw)] == solo


def test_the_entry_validates_its_options(toy):
    assert DraftConfig(toy, num_speculations=5).num_speculations == 5
    with pytest.raises(SelfSpecError, match="max_ngram is not used by the"):
        DraftConfig(toy, max_ngram=2)
    with pytest.raises(SelfSpecError, match="lookup_first combines"):
        DraftConfig(toy, lookup_first=True)
    with pytest.raises(SelfSpecError, match="registered already"):
        register(toy_entry(toy, "solo"))


def test_unknown_strategies_are_refused_everywhere(model):
    with pytest.raises(SelfSpecError, match="unknown strategy 'repeat-free'"):
        DraftConfig("repeat-free")
    with pytest.raises(SelfSpecError, match="unknown strategy"):
        model.generate([1, 2], strategy="nope")
    with pytest.raises(SelfSpecError, match="unknown batching"):
        Strategy("x", frozenset(), lambda *a: None, batching="sideways")


def test_the_built_in_entries(model):
    assert strategies.names() == ("autoregressive", "early-exit", "layer-skip", "exit-adapter", "quantized", "draft-model",
                                  "prompt-lookup", "auto")
    kinds = {n: strategies.strategy(n).batching for n in strategies.names()}
    assert kinds == {"autoregressive": "plain", "early-exit": "depth", "layer-skip": "depth", "exit-adapter": "solo",
                     "quantized": "depth", "draft-model": "solo", "prompt-lookup": "free", "auto": "solo"}
    assert [n for n in strategies.names() if strategies.strategy(n).self_drafting] == [
        "early-exit", "layer-skip", "exit-adapter", "quantized"]
    # the drafters built say the same (batch/sequence.kind_of reads them)
    d = model.drafter(DraftConfig("early-exit", exit_layer=2))
    assert d.batching == "depth" and model.drafter(DraftConfig("early-exit", exit_layer=2, lookup_first=True)).batching == "solo"
    assert model.drafter(DraftConfig("auto", base=DraftConfig("layer-skip", skip_mlp=(1,)))).batching == "depth"
