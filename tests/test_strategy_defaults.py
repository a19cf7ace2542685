"""A strategy named without options takes its best measured configuration for the model (issue
45): the profile's per-strategy options first, then the predictor's calibrated choice (kept on
disk), then the static defaults; options given override only themselves."""

from __future__ import annotations

import argparse
import json

import pytest

import selfspec
from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.profiles import PACKAGED, Profile, best_options, install_profile, load_profile, save_profile
from helpers import ar_generate, build_hf, prompts, word_tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))  # the user's installed profiles live here
    monkeypatch.setenv("SELFSPEC_COSTS_DIR", str(tmp_path / "costs"))
    return tmp_path


def _model(seed=21, tokenizer=False):
    return selfspec.load(build_hf("llama", seed=seed, num_layers=4), dtype="float32",
                         tokenizer=word_tokenizer() if tokenizer else None)


def test_explicit_options_leave_out_defaults_and_derived_values():
    assert DraftConfig("quantized").explicit_options() == {}
    assert DraftConfig("quantized", draft_bits=4).explicit_options() == {"draft_bits": 4}  # head_bits follows it
    assert DraftConfig("quantized", draft_bits=4, head_bits=8).explicit_options() == {"draft_bits": 4, "head_bits": 8}
    assert DraftConfig("early-exit", exit_layer=3, num_speculations=6, skip_attn=()).explicit_options() == {"exit_layer": 3, "num_speculations": 6}
    assert DraftConfig("layer-skip", skip_mlp=(2, 1), adaptive=True).explicit_options() == {"skip_mlp": [1, 2], "adaptive": True}


def test_profile_strategies_map_round_trips_and_old_profiles_still_load(tmp_path):
    strategies = {"early-exit": {"options": {"exit_layer": 2, "num_speculations": 6}, "metrics": {"measured_speedup": 0.8}}}
    p = Profile(DraftConfig("prompt-lookup", num_speculations=2), "ab" * 8, "m", {"measured_speedup": 1.3}, strategies=strategies)
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").strategies == strategies
    old = Profile(DraftConfig("prompt-lookup"), "ab" * 8).to_dict()
    assert "strategies" not in old  # a profile without the map is written as before
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_profile(tmp_path / "old.json").strategies == {}
    for bad in ({"early-exit": {"options": {"exit_layer": 2, "max_ngram": "x"}}}, {"early-exit": [1]},
                {"auto": {"options": {}}}, {"early-exit": {"options": {"num_speculations": 99, "exit_layer": 2}}}):
        (tmp_path / "bad.json").write_text(json.dumps({**old, "strategies": bad}))
        with pytest.raises(SelfSpecError, match="bad"):
            load_profile(tmp_path / "bad.json")


def test_the_shipped_profile_measured_every_self_drafting_strategy():
    """The default model's profile holds a best configuration for each strategy a user can name
    bare, each with its measured speedup (produced by a search, not typed in)."""
    prof = load_profile(PACKAGED / "gemma-3-270m.json")
    assert {"early-exit", "layer-skip", "quantized", "prompt-lookup"} <= set(prof.strategies)
    for name, entry in prof.strategies.items():
        cfg = DraftConfig.from_dict({**entry["options"], "strategy": name})
        assert isinstance(entry["metrics"].get("measured_speedup"), float), name
        assert entry["metrics"]["identical_to_autoregressive"] is True, name
        assert cfg.label() == entry["metrics"]["label"], name
    q = prof.strategies["quantized"]
    assert q["options"].get("draft_vocab"), "the quantized default drafts over a restricted head"


def test_a_named_strategy_takes_the_profiles_best_options_and_given_ones_override_only_themselves(cache):
    m = _model()
    with pytest.raises(SelfSpecError, match="needs an exit layer"):
        m.draft_config("early-exit")  # no profile, no tokenizer to calibrate with: the static defaults
    assert m.draft_config("prompt-lookup") == DraftConfig("prompt-lookup")
    strategies = {"early-exit": {"options": {"exit_layer": 2, "num_speculations": 6, "draft_threshold": 0.3}, "metrics": {}},
                  "prompt-lookup": {"options": {"num_speculations": 7, "max_ngram": 2}, "metrics": {}}}
    install_profile(Profile(DraftConfig("layer-skip", skip_mlp=(1,), num_speculations=2), m.fingerprint, "tiny",
                            {"measured_speedup": 1.2}, strategies=strategies))
    assert m.draft_config("early-exit") == DraftConfig("early-exit", exit_layer=2, num_speculations=6, draft_threshold=0.3)
    assert m.draft_config("early-exit", num_speculations=3) == DraftConfig("early-exit", exit_layer=2, num_speculations=3,
                                                                            draft_threshold=0.3)
    assert m.draft_config("early-exit", exit_layer=1).exit_layer == 1
    assert m.draft_config("prompt-lookup", max_ngram=4) == DraftConfig("prompt-lookup", num_speculations=7, max_ngram=4)
    assert m.draft_config("layer-skip") == DraftConfig("layer-skip", skip_mlp=(1,), num_speculations=2)  # the profile's own draft
    assert m.draft_config("autoregressive") == DraftConfig("autoregressive")
    assert m.draft_config() == DraftConfig()  # auto: gates the profile's draft when it builds
    assert m.strategy_defaults("prompt-lookup")[1].startswith("profile: ")
    # what a generation drafted with is in its stats, and lossless
    p = prompts(n=1, seed=3)[0]
    out = m.generate(p, max_new_tokens=12, strategy="early-exit")
    assert out.stats.draft["draft"]["num_speculations"] == 6 and out.stats.draft["draft"]["exit_layer"] == 2
    assert out.token_ids == ar_generate(m, p, max_new_tokens=12).token_ids
    assert best_options(m.fingerprint, "quantized") is None


def test_without_a_profile_the_predictor_chooses_and_the_choice_is_kept(cache, monkeypatch):
    from selfspec.predictor import objective, options
    from selfspec.predictor.simulate import Prediction

    m = _model(seed=22, tokenizer=True)
    calls = []

    def fake(cfg, cal, costs, *a, **k):  # the ranking: K=7 with 2-grams predicted best
        calls.append(cfg)
        return Prediction(tokens=10, steps=10, time_s=1.0, ar_time_s=1.0 + (cfg.num_speculations == 7) + (cfg.max_ngram == 2))

    monkeypatch.setattr(objective, "predict", fake)
    cfg = m.draft_config("prompt-lookup")
    assert cfg == DraftConfig("prompt-lookup", num_speculations=7, max_ngram=2)
    assert len(calls) == 8 * 4  # the grid: K 1..8 x n-gram 1..4
    assert m.draft_config("prompt-lookup", max_ngram=3) == DraftConfig("prompt-lookup", num_speculations=7, max_ngram=3)
    assert m.strategy_defaults("prompt-lookup")[1] == "calibrated"
    monkeypatch.setattr(options, "_rank", lambda *a: pytest.fail("calibrated again"))
    again = selfspec.load(build_hf("llama", seed=22, num_layers=4), dtype="float32", tokenizer=word_tokenizer())
    assert again.draft_config("prompt-lookup") == cfg  # kept on disk: a new process does not calibrate again
    with pytest.raises(SelfSpecError, match="needs an exit layer"):
        m.draft_config("early-exit")  # a required option is the user's (or a profile's) to give


def test_the_calibrated_choice_is_real_and_lossless(cache):
    m = _model(seed=23, tokenizer=True)
    cfg = m.draft_config("prompt-lookup")
    assert 1 <= cfg.num_speculations <= 8 and 1 <= cfg.max_ngram <= 4
    p = prompts(n=1, seed=4)[0]
    assert m.generate(p, max_new_tokens=10, draft=cfg).token_ids == ar_generate(m, p, max_new_tokens=10).token_ids
    # a strategy that needs an option (an exit layer) is not calibrated: given it, the static defaults
    assert m.draft_config("early-exit", exit_layer=2) == DraftConfig("early-exit", exit_layer=2)


def test_the_cli_leaves_a_required_option_to_the_profile(cache):
    """`--strategy early-exit` with no --exit-layer is checked before loading with a stand-in
    for it (the profile may supply it); its other options still are."""
    from selfspec.cli_args import check_before_loading

    ns = lambda **kw: argparse.Namespace(model="gemma-3-270m", profile=None, **{"strategy": None, **kw})  # noqa: E731
    check_before_loading(ns(strategy="early-exit"))
    check_before_loading(ns(strategy="layer-skip", num_speculations=6))
    with pytest.raises(SelfSpecError, match="num_speculations"):
        check_before_loading(ns(strategy="early-exit", num_speculations=99))
    with pytest.raises(SelfSpecError, match="exit layer"):
        check_before_loading(ns(strategy="early-exit", exit_layer=40))  # the default model has 18 layers


def test_calibration_texts_that_end_at_once_leave_the_static_defaults(cache, monkeypatch):
    """A model that ends every calibration text within a token (an immediate EOS; here one new
    token) has nothing to rank on: the static defaults, with a note, not a crash at load or
    serve, and no choice kept (calibrated again next time)."""
    from selfspec.predictor import objective, options

    monkeypatch.setattr(options, "NEW_TOKENS", 1)
    m = _model(seed=24, tokenizer=True)
    assert m.draft_config("quantized") == DraftConfig("quantized")
    ranked = []
    monkeypatch.setattr(options, "_rank", lambda *a: ranked.append(a) or None)
    m.draft_config("quantized")
    assert ranked  # nothing was kept
    with pytest.raises(SelfSpecError, match="nothing to calibrate on"):
        objective.Calibration(m, ["the cat"], 1)
