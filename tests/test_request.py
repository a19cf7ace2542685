"""One request object (issue 54, part 4): `selfspec.Request`, built and validated in one place
(request.configs, Request.build / Request.batch) and run the same by every runner: generate,
generate_batch, SelfSpecModel.run / run_batch, the batch engine; the CLI's flags and the
server's fields become the same builder's keywords."""

from __future__ import annotations

import dataclasses
import json

import pytest

import selfspec
from selfspec import DraftChoice, Request
from selfspec.batch import BatchEngine, BatchRequest
from selfspec.cli import build_parser
from selfspec.cli_args import request_options
from selfspec.config import DraftConfig, GenerationConfig, Grammar, LogitBias, SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec.request import configs
from selfspec.server.errors import APIError
from selfspec.server.parsing import ParseContext, encode, parse_request
from selfspec.server.settings import ServerSettings

from helpers import ar_generate, prompts

N_NEW = 12
EE = dict(strategy="early-exit", exit_layer=2, num_speculations=3)


@pytest.fixture(scope="module")
def model(zoo):
    return zoo.get("llama")[1]


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


# ---- the builder validates -------------------------------------------------------------------


def test_unknown_option_is_one_line(model):
    ids = prompts(n=1)[0]
    with pytest.raises(SelfSpecError) as e:
        Request.build(model, ids, strategy="autoregressive", exit_layr=2)
    assert _one_line(e) == "unknown option(s): exit_layr"
    with pytest.raises(SelfSpecError) as e:
        configs(strategy="erly-exit")  # without a model too
    assert "did you mean early-exit?" in _one_line(e)
    with pytest.raises(SelfSpecError) as e:
        DraftChoice("early-exit", options={"exit_layr": 2})
    assert _one_line(e) == "unknown option(s): exit_layr"


def test_draft_and_strategy_together_are_refused(model):
    ids = prompts(n=1)[0]
    for kw in (dict(strategy="early-exit"), dict(exit_layer=2), dict(profile="p.json")):
        with pytest.raises(SelfSpecError, match="pass either draft=") as e:
            Request.build(model, ids, draft=DraftConfig("autoregressive"), **kw)
        _one_line(e)


def test_json_schema_becomes_a_grammar(model):
    ids = prompts(n=1)[0]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = Request.build(model, ids, strategy="autoregressive", json_schema=schema)
    assert r.sampling.grammar == Grammar("json_schema", json.dumps(schema))
    assert Request.build(model, ids, strategy="autoregressive", json_schema=json.dumps(schema)).sampling == r.sampling
    with pytest.raises(SelfSpecError, match="either grammar= or json_schema="):
        Request.build(model, ids, strategy="autoregressive", json_schema=schema, grammar=Grammar("json_object"))


def test_budget_is_cut_to_the_context_left(model):
    ids = prompts(n=1, lengths=(20,))[0]
    r = Request.build(model, ids, max_new_tokens=10**6, strategy="autoregressive")
    assert r.gen.max_new_tokens == model.context_length - len(ids)
    assert Request.build(model, ids, max_new_tokens=N_NEW, strategy="autoregressive").gen.max_new_tokens == N_NEW
    # a request made directly is cut when it runs (fitted); one that fits is itself
    direct = Request(ids, GenerationConfig(10**6), draft=DraftConfig("autoregressive"))
    assert direct.fitted(model).gen.max_new_tokens == model.context_length - len(ids)
    fits = Request(ids, GenerationConfig(N_NEW), draft=DraftConfig("autoregressive"))
    assert fits.fitted(model) is fits


def test_prompt_is_checked_against_the_model(model):
    with pytest.raises(SelfSpecError) as e:
        Request(ids := [1, 2, model.spec.vocab_size], draft=DraftConfig("autoregressive")).fitted(model)
    assert _one_line(e) == f"token id {ids[-1]} is outside the vocabulary (size {model.spec.vocab_size})"
    with pytest.raises(SelfSpecError, match="context is"):
        Request([1] * model.context_length).fitted(model)
    with pytest.raises(SelfSpecError, match="the prompt is empty"):
        Request([])
    with pytest.raises(SelfSpecError, match="token ids"):
        Request("hello")
    with pytest.raises(SelfSpecError, match="sampling must be a SamplingConfig"):
        Request([1, 2], sampling={"temperature": 0.5})


def test_batch_seeds_must_match_the_prompts(model):
    ps = prompts(n=2)
    with pytest.raises(SelfSpecError) as e:
        Request.batch(model, ps, seed=[1], strategy="autoregressive")
    assert _one_line(e) == "1 seeds for 2 prompts"
    with pytest.raises(SelfSpecError, match="1 seeds for 2 prompts"):
        model.generate_batch(ps, seed=[1], strategy="autoregressive")
    rs = Request.batch(model, ps, seed=[5, 6], temperature=0.7, strategy="autoregressive")
    assert [r.sampling.seed for r in rs] == [5, 6] and [r.prompt_ids for r in rs] == [tuple(p) for p in ps]
    assert {r.draft for r in rs} == {DraftConfig("autoregressive")}  # resolved once, shared


def test_defaults_are_the_dataclasses(model):
    r = Request.build(model, prompts(n=1)[0], strategy="autoregressive")
    assert r.gen == GenerationConfig() and r.sampling == SamplingConfig()
    assert Request([1, 2]).draft == DraftChoice()
    assert Request([1, 2]).fitted(model).draft == model.draft_config()  # the model's default (auto)


def test_frozen_and_normalised(model):
    r = Request([3, 4, 5], draft=DraftChoice("early-exit", options={"exit_layer": 2, "skip_mlp": None}))
    assert r.prompt_ids == (3, 4, 5) and r.draft.options == (("exit_layer", 2),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.prompt_ids = (1,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.draft.strategy = "autoregressive"
    assert hash(r) == hash(Request((3, 4, 5), draft=DraftChoice("early-exit", options=(("exit_layer", 2),))))
    assert r.fitted(model).draft == model.draft_config("early-exit", exit_layer=2)
    assert BatchRequest is Request and selfspec.Request is Request


def test_configs_without_a_model_leave_the_draft_a_choice(model):
    gen, sampling, draft = configs(max_new_tokens=5, temperature="0.5", stop="END", stop_token_ids="7,3", **EE)
    assert gen == GenerationConfig(5, ("END",), stop_token_ids=(3, 7)) and sampling.temperature == 0.5
    assert isinstance(draft, DraftChoice) and draft.resolve(model) == configs(model, **EE)[2] == model.draft_config(**EE)


# ---- one request, every runner ---------------------------------------------------------------


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, seed=3)], ids=["greedy", "seeded"])
def test_one_request_runs_the_same_everywhere(model, sampling):
    """A Request built once gives the same tokens through generate, run, generate_batch,
    run_batch and the batch engine, and those of plain autoregressive decoding."""
    p, other = prompts(n=2, seed=3, lengths=(9, 5))
    req = Request.build(model, p, max_new_tokens=N_NEW, **sampling, **EE)
    ref = ar_generate(model, p, max_new_tokens=N_NEW, **sampling).token_ids
    assert model.generate(p, max_new_tokens=N_NEW, **sampling, **EE).token_ids == ref
    assert model.run(req).token_ids == ref
    assert model.generate_batch([p, other], max_new_tokens=N_NEW, **sampling, **EE)[0].token_ids == ref
    assert model.run_batch([req, Request.build(model, other, max_new_tokens=N_NEW, **sampling, **EE)])[0].token_ids == ref
    engine = BatchEngine(model)
    handle = engine.submit(req)
    engine.submit(dataclasses.replace(req, prompt_ids=other))
    engine.run()
    assert handle.result.token_ids == ref
    # a request made from configs, its draft a choice the engine resolves
    choice = Request(p, GenerationConfig(N_NEW), SamplingConfig(**sampling), DraftChoice(EE["strategy"], options={
        k: v for k, v in EE.items() if k != "strategy"}))
    engine = BatchEngine(model)
    handle = engine.submit(choice)
    engine.run()
    assert handle.result.token_ids == ref == model.run(choice).token_ids
    assert handle.request.draft == req.draft


def test_events_stream_through_the_request(model):
    p = prompts(n=1)[0]
    seen: list[int] = []
    out = model.run(Request.build(model, p, max_new_tokens=N_NEW, on_event=lambda ev: seen.append(ev.token_id), **EE))
    assert seen == out.token_ids
    both: list[tuple[int, int]] = []
    outs = model.generate_batch([p, p], max_new_tokens=N_NEW, on_event=lambda i, ev: both.append((i, ev.token_id)), **EE)
    assert [t for i, t in both if i == 1] == outs[1].token_ids == out.token_ids


# ---- the CLI and the server use the same builder ---------------------------------------------


def test_cli_flags_are_the_builders_keywords(model):
    args = build_parser().parse_args(["generate", "hi", "--max-new-tokens", "9", "--temperature", "0.5", "--seed", "4",
                                      "--stop", "END", "--stop-token-ids", "7,3", "--logit-bias", "5=-100",
                                      "--strategy", "early-exit", "--exit-layer", "2", "--num-speculations", "3"])
    options = request_options(args, chat=False)
    gen, sampling, draft = configs(**options)
    assert gen == GenerationConfig(9, ("END",), stop_token_ids=(3, 7))
    assert sampling == SamplingConfig(0.5, seed=4, logit_bias=LogitBias(((5, -100.0),)))
    assert draft == DraftChoice("early-exit", options={"exit_layer": 2, "num_speculations": 3})
    assert Request.build(model, [1, 2, 3], **options) == Request.build(
        model, [1, 2, 3], max_new_tokens=9, temperature=0.5, seed=4, stop=["END"], stop_token_ids=[3, 7],
        logit_bias={5: -100}, **EE)


def test_the_server_builds_the_same_request(model):
    served = DraftConfig("autoregressive")
    ctx = ParseContext.for_model(model, served, ServerSettings(allowed_strategies=("autoregressive",)))
    ids = prompts(n=1)[0]
    body = {"model": "selfspec", "prompt": ids, "max_tokens": 7, "temperature": 0.5, "seed": 3, "presence_penalty": 0.5,
            "stop_token_ids": [4]}
    params = encode(parse_request(body, False, ctx), model, ctx)
    assert params.request == Request.build(model, ids, max_new_tokens=7, temperature=0.5, seed=3, presence_penalty=0.5,
                                           stop_token_ids=[4], draft=served)
    assert params.prompt_ids == ids and params.sampling.seed == 3 and params.stop_token_ids == (4,)
    # the builder's own checks answer as the 400 naming the field
    for field, value, message in (("top_p", 1.5, "'top_p' must be in (0, 1], got 1.5."),
                                  ("presence_penalty", 2.5, "'presence_penalty' must be in [-2, 2], got 2.5."),
                                  ("min_p", 1.0, "'min_p' must be in [0, 1), got 1.0.")):
        with pytest.raises(APIError) as e:
            parse_request({**body, field: value}, False, ctx)
        assert (e.value.status, e.value.param, e.value.code, e.value.message) == (400, field, "invalid_value", message)
