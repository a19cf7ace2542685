"""Configuration: every externally supplied option gets its field's type in one place
(coercion.coerce), and an option the chosen strategy would not use is an error, not ignored."""

from __future__ import annotations

import pytest

from selfspec.coercion import ConfigError, ConfigTypeError, typed
from selfspec import strategies
from selfspec.config import DraftConfig, GenerationConfig, SamplingConfig
from selfspec.errors import SelfSpecError


def test_text_values_get_their_field_types():
    """CLI / Ray builder args arrive as strings; profiles and the API as typed values."""
    cfg = DraftConfig.from_dict({"strategy": "early-exit", "exit_layer": "3", "num_speculations": " 6",
                                 "lookup_first": "false", "draft_threshold": "0.25", "adaptive": "TRUE"})
    assert (cfg.exit_layer, cfg.num_speculations, cfg.lookup_first, cfg.draft_threshold, cfg.adaptive) == (3, 6, False, 0.25, True)
    assert DraftConfig.from_dict({"strategy": "early-exit", "exit_layer": 2, "lookup_first": "yes"}).lookup_first is True
    assert DraftConfig("layer-skip", skip_attn="5, 3,3", skip_mlp=[2, "1"]).skip_attn == (3, 5)
    assert DraftConfig("layer-skip", skip_mlp=[2, "1"]).skip_mlp == (1, 2)
    assert SamplingConfig(temperature="0.7", top_k="40", seed="3") == SamplingConfig(temperature=0.7, top_k=40, seed=3)
    assert GenerationConfig(max_new_tokens="12", stop="END").stop == ("END",)
    base = DraftConfig.from_dict({"strategy": "auto", "base": {"strategy": "prompt-lookup", "num_speculations": "2"}})
    assert base.base == DraftConfig("prompt-lookup", num_speculations=2)


@pytest.mark.parametrize("field,value,fragment", [
    ("lookup_first", "maybe", "true or false"),
    ("lookup_first", 1, "true or false"),  # not silently truthy
    ("exit_layer", "three", "integer"),
    ("exit_layer", 2.5, "integer"),
    ("exit_layer", True, "integer"),
    ("draft_threshold", "high", "number"),
    ("skip_mlp", "1,x", "list of integers"),
    ("skip_mlp", {"a": 1}, "list"),
    ("strategy", 3, "string"),
])
def test_wrong_types_are_one_line_errors(field, value, fragment):
    base = {"strategy": "early-exit", "exit_layer": 2} if field != "skip_mlp" else {"strategy": "layer-skip"}
    with pytest.raises(ConfigTypeError) as e:
        DraftConfig.from_dict({**base, field: value})
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert e.value.field == field


def test_json_values_must_already_have_their_type():
    """HTTP bodies are JSON: a string where a number belongs is a type error, not parsed."""
    assert typed(DraftConfig, {"num_speculations": 4, "draft_threshold": 1, "skip_mlp": [1]}, text=False) == {
        "num_speculations": 4, "draft_threshold": 1.0, "skip_mlp": (1,)}
    for bad in ({"num_speculations": "4"}, {"adaptive": "true"}, {"skip_mlp": "1,2"}, {"draft_threshold": "0.5"}):
        with pytest.raises(ConfigTypeError):
            typed(DraftConfig, bad, text=False)
    assert typed(DraftConfig, {"num_speculations": "4"}, text=True) == {"num_speculations": 4}


@pytest.mark.parametrize("cfg,field", [
    (dict(strategy="auto", exit_layer=999), "exit_layer"),
    (dict(strategy="auto", num_speculations=8), "num_speculations"),
    (dict(strategy="autoregressive", num_speculations=8), "num_speculations"),
    (dict(strategy="prompt-lookup", exit_layer=3), "exit_layer"),
    (dict(strategy="prompt-lookup", draft_vocab=100), "draft_vocab"),
    (dict(strategy="early-exit", exit_layer=2, skip_mlp=(1,)), "skip_mlp"),
    (dict(strategy="early-exit", exit_layer=2, max_ngram=5), "max_ngram"),  # only with lookup_first
    (dict(strategy="layer-skip", skip_mlp=(1,), exit_layer=2), "exit_layer"),
    (dict(strategy="draft-model", draft_model="x", lookup_first=False, adapter="a.safetensors"), "adapter"),
    (dict(strategy="auto", base=DraftConfig("prompt-lookup"), draft_vocab=100), "draft_vocab"),
    (dict(strategy="early-exit", exit_layer=2, base=DraftConfig("prompt-lookup")), "base"),
])
def test_options_the_strategy_does_not_use_are_errors(cfg, field):
    with pytest.raises(ConfigError) as e:
        DraftConfig(**cfg)
    assert e.value.field == field
    assert f"{field} is not used by the {cfg['strategy']} strategy" in str(e.value)


def test_every_used_option_is_accepted():
    """The table is not stricter than the strategies: each listed field can be set."""
    DraftConfig("early-exit", exit_layer=2, num_speculations=6, draft_threshold=0.3, adaptive=True, draft_vocab=50,
                lookup_first=True, max_ngram=2)
    DraftConfig("layer-skip", skip_attn=(1,), skip_mlp=(2,), num_speculations=3, draft_vocab=50)
    DraftConfig("exit-adapter", adapter="a.safetensors", exit_layer=2, lookup_first=True, max_ngram=1)
    DraftConfig("draft-model", draft_model="m", num_speculations=2, draft_threshold=0.5, draft_vocab=50)
    DraftConfig("prompt-lookup", num_speculations=8, max_ngram=1)
    DraftConfig("auto", draft_vocab=50, max_ngram=2)
    DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=2))
    DraftConfig("quantized", draft_bits=4, head_bits=8, exit_layer=3, skip_attn=(1,), skip_mlp=(2,), num_speculations=5,
                draft_threshold=0.2, adaptive=True, draft_vocab=50, lookup_first=True, max_ngram=2)
    assert set(strategies.names()) == {"autoregressive", "early-exit", "layer-skip", "exit-adapter", "quantized", "draft-model",
                                    "prompt-lookup", "auto"}


def test_quantized_options():
    q = DraftConfig("quantized")
    assert (q.draft_bits, q.head_bits) == (8, 8) and q.draft_head() == (None, 8)
    assert DraftConfig("quantized", draft_bits=4).head_bits == 4
    assert DraftConfig.from_dict({"strategy": "quantized", "draft_bits": "4", "head_bits": "8"}).label() == "quantized int4/head int8 K=4"
    for bad in ({"draft_bits": 3}, {"head_bits": 16}):
        with pytest.raises(ConfigError, match="must be 8 or 4"):
            DraftConfig("quantized", **bad)
    with pytest.raises(ConfigError, match="draft_bits is not used by the early-exit strategy"):
        DraftConfig("early-exit", exit_layer=2, draft_bits=8)


def test_labels():
    assert DraftConfig("early-exit", exit_layer=12, num_speculations=3, draft_vocab=16384).label() == "early-exit E=12 K=3 vocab=16384"
    assert DraftConfig("prompt-lookup", num_speculations=2).label() == "prompt-lookup n=3 K=2"
    assert DraftConfig("layer-skip", skip_mlp=(1, 2), draft_threshold=0.3, adaptive=True).label() == "layer-skip attn=- mlp=1,2 K=4 thr=0.3(adaptive)"
    assert DraftConfig("quantized", lookup_first=True).label() == "quantized int8 n=3 K=4 +lookup"
    assert DraftConfig("auto", base=DraftConfig("prompt-lookup", num_speculations=2)).label() == "auto [prompt-lookup n=3 K=2]"
    assert DraftConfig("autoregressive").label() == "autoregressive"


def test_profile_fields_follow_the_strategy(zoo, tmp_path):
    """A profile refines its own strategy; auto gates it (options refine the gated draft); another
    strategy cannot silently inherit options it would ignore."""
    from selfspec.profiles import Profile, save_profile

    _, m = zoo.get("llama")
    path = tmp_path / "p.json"
    save_profile(Profile(DraftConfig("early-exit", exit_layer=2, num_speculations=3), m.fingerprint), path)
    assert m.draft_config(profile=str(path), num_speculations=5) == DraftConfig("early-exit", exit_layer=2, num_speculations=5)
    gated = m.draft_config("auto", profile=str(path), num_speculations=5)
    assert gated == DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=2, num_speculations=5))
    with pytest.raises(SelfSpecError, match="profile drafts with early-exit"):
        m.draft_config("prompt-lookup", profile=str(path))
    with pytest.raises(SelfSpecError, match="exit_layer is not used by the auto strategy"):
        m.generate([1, 2, 3], max_new_tokens=2, strategy="auto", exit_layer=2)


def test_ray_builder_args_are_typed():
    from selfspec.server.ray_deploy import _coerce

    assert _coerce("warmup", "false") is False and _coerce("replicas", "3") == 3 and _coerce("num_cpus", "0.5") == 0.5
    assert _coerce("model", "gemma-3-270m") == "gemma-3-270m"
    with pytest.raises(ConfigTypeError, match="replicas must be an integer"):
        _coerce("replicas", "two")


def test_server_settings_are_typed():
    from selfspec.server.app import ServerSettings

    s = ServerSettings(max_concurrency="4", queue_timeout_s="2.5", allow_request_draft="false", aliases="x")
    assert (s.max_concurrency, s.queue_timeout_s, s.allow_request_draft, s.aliases) == (4, 2.5, False, ("x",))
    with pytest.raises(ConfigTypeError, match="max_concurrency must be an integer"):
        ServerSettings(max_concurrency="many")


def test_unknown_strategy_names_the_closest():
    with pytest.raises(ConfigError, match="unknown strategy 'erly-exit'; did you mean early-exit"):
        DraftConfig.from_dict({"strategy": "erly-exit"})
