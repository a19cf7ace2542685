"""The suite's lossless references are plain decoding, and cannot silently stop being so.

Since auto became the default strategy, `model.generate(prompt)` drafts: a reference taken
that way compares speculative decoding with itself. Two mechanisms keep that from coming
back: conftest.py fails any generate() called from a test file without a named strategy,
and helpers.ar_generate (the one way references are taken) pins plain decoding and checks
that the result really is plain.
"""

from __future__ import annotations

import pytest

from selfspec.config import DraftConfig, GenerationConfig, SamplingConfig
from selfspec.drafters import make_drafter
from selfspec.engine import generate

from conftest import DEFAULT_STRATEGY_ALLOWED, TESTS
from helpers import ar_generate, assert_plain, prompts


def test_generate_without_a_strategy_fails_in_a_test(zoo):
    _, m = zoo.get("llama")
    p = prompts(n=1)[0]
    with pytest.raises(AssertionError, match="name the strategy"):
        m.generate(p, max_new_tokens=4)
    options: dict = {}  # the shape the old references had: a config dict that may be empty
    with pytest.raises(AssertionError, match="name the strategy"):
        m.generate(p, max_new_tokens=4, **options)
    assert m.generate(p, max_new_tokens=4, strategy="auto").token_ids == ar_generate(m, p, max_new_tokens=4).token_ids


def test_the_allow_list_names_only_existing_files():
    """Files owned elsewhere for now; each name must go once its calls name a strategy."""
    assert DEFAULT_STRATEGY_ALLOWED <= {p.name for p in TESTS.glob("test_*.py")}
    assert "test_engine.py" not in DEFAULT_STRATEGY_ALLOWED and "test_default_model.py" not in DEFAULT_STRATEGY_ALLOWED


def test_ar_generate_is_plain_decoding(zoo):
    _, m = zoo.get("gemma3")
    p = prompts(n=1)[0]
    for named in (dict(strategy="auto"), dict(draft=DraftConfig("autoregressive")), dict(profile="p.json")):
        with pytest.raises(TypeError, match="pins the strategy"):
            ar_generate(m, p, max_new_tokens=4, **named)
    ref = ar_generate(m, p, max_new_tokens=20)
    rt = m.runtime
    engine = generate(rt, make_drafter(rt, DraftConfig("autoregressive")), p, GenerationConfig(20), SamplingConfig())
    assert ref.token_ids == engine.token_ids and ref.stats.verify_steps == 19


def test_assert_plain_refuses_auto_even_on_a_step_it_does_not_draft(zoo):
    """auto is no reference even where it decodes plainly: it has draft slots (K >= 1)."""
    _, m = zoo.get("llama")
    p = prompts(n=1)[0]
    cfg = DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=3, num_speculations=4))
    undrafted = m.generate(p, max_new_tokens=2, draft=cfg)  # one step, with k = 0
    assert undrafted.stats.drafted == 0
    with pytest.raises(AssertionError, match="the reference drafted"):
        assert_plain(undrafted)
    drafting = m.generate(p, max_new_tokens=20, draft=cfg)
    assert drafting.stats.drafted > 0
    with pytest.raises(AssertionError, match="the reference drafted"):
        assert_plain(drafting)
