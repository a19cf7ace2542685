"""Issue 46: what OpenAI clients send, through the openai client against an in-process server
(the tiny random Llama of test_server): n choices, stop token ids, max_completion_tokens, and
every new field's validation (a 400 in OpenAI's shape naming the field, never a 500)."""

import json
import re

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import selfspec  # noqa: E402
from selfspec.server.app import create_app  # noqa: E402
from selfspec.server.choices import choice_seed  # noqa: E402

from test_server import NAME, STRATEGY, InProcessServer, _settings, build_tiny_model, direct  # noqa: E402

PROMPT = "Once upon a time there was"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield selfspec.load(str(build_tiny_model(tmp_path_factory.mktemp("tiny-options") / "model")), dtype="float32", device="cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def srv(model):
    app = create_app(model, selfspec.DraftConfig(**STRATEGY), _settings(max_batch=4))
    with InProcessServer(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(srv, body, path="/v1/completions"):
    return httpx.post(srv.url + path, json={"model": NAME, **body}, timeout=120)


def stream_texts(chunks, chat=False) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            out[ch.index] = out.get(ch.index, "") + ((ch.delta.content or "") if chat else ch.text)
    return out


def test_choice_seeds():
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(None, 2) is None
    assert choice_seed(2**64 - 1, 1) == 0 and choice_seed(2**64 - 2, 1) == 2**64 - 1


def test_n_choices_seeded_each_reproducible(client, model):
    """Choice i samples with seed + i: it is the direct generation with that seed, streamed or
    not, on both endpoints."""
    kw = dict(temperature=0.9, top_p=0.95, seed=11)
    refs = [direct(model, PROMPT, max_new_tokens=12, **{**kw, "seed": 11 + i}).text for i in range(3)]
    assert len(set(refs)) > 1  # the choices are distinct samples
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == refs
    assert r.usage.completion_tokens == sum(len(direct(model, PROMPT, max_new_tokens=12, **{**kw, "seed": 11 + i}).token_ids)
                                            for i in range(3))
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, n=3, stream=True, **kw))
    assert stream_texts(chunks) == dict(enumerate(refs))
    finals = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(i for i, _ in finals) == [0, 1, 2]
    msgs = [{"role": "user", "content": PROMPT}]
    chat_refs = [direct(model, PROMPT, max_new_tokens=10, chat=True, **{**kw, "seed": 11 + i}).text for i in range(2)]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, n=2, **kw)
    assert [c.message.content for c in r.choices] == chat_refs
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, n=2, stream=True, **kw))
    assert stream_texts(chunks, chat=True) == dict(enumerate(chat_refs))


def test_n_greedy_choices_are_one_text(srv, client, model):
    ref = direct(model, PROMPT, max_new_tokens=10)
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, n=3, temperature=0)
    assert [c.text for c in r.choices] == [ref.text] * 3
    assert r.usage.completion_tokens == 3 * len(ref.token_ids)
    r = post(srv, {"prompt": PROMPT, "max_tokens": 10, "n": 2, "temperature": 0, "stream": True,
                              "stream_options": {"include_usage": True}})
    objs = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    texts = {}
    for o in objs:
        for c in o["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: ref.text, 1: ref.text}
    assert objs[-1]["usage"]["completion_tokens"] == 2 * len(ref.token_ids)


def test_stop_token_ids(client, model):
    """A stop token ends the choice like EOS: in neither the text nor the stream; finish "stop"."""
    ref = direct(model, PROMPT, max_new_tokens=16)
    stop = ref.token_ids[5]
    first = ref.token_ids.index(stop)
    cut = direct(model, PROMPT, max_new_tokens=16, stop_token_ids=[stop])
    assert cut.token_ids == ref.token_ids[: first + 1] and cut.finish_reason == "stop"
    assert cut.text == model.tokenizer.decode(ref.token_ids[:first], skip_special_tokens=True)
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].text == cut.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == first + 1
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            extra_body={"stop_token_ids": [stop]}))
    assert stream_texts(chunks) == {0: cut.text}


def test_max_completion_tokens_on_both_endpoints(srv, model):
    ref = direct(model, PROMPT, max_new_tokens=5)
    r = post(srv, {"prompt": PROMPT, "max_completion_tokens": 5, "max_tokens": 9, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
    r = post(srv, {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "temperature": 0},
             "/v1/chat/completions")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


BAD = [
    ({"n": 0}, "n", "invalid_value"),
    ({"n": 17}, "n", "invalid_value"),
    ({"n": "2"}, "n", "invalid_type"),
    ({"n": 1.0}, "n", "invalid_type"),
    ({"stop_token_ids": 5}, "stop_token_ids", "invalid_type"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids", "invalid_type"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids", "invalid_value"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "invalid_value"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"max_completion_tokens": "x"}, "max_completion_tokens", "invalid_type"),
    ({"best_of": 3}, "best_of", "unsupported_parameter"),
    ({"suffix": "x"}, "suffix", "unsupported_parameter"),
]


@pytest.mark.parametrize("extra,param,code", BAD)
def test_bad_values_are_400_naming_the_field(srv, extra, param, code):
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        if path.endswith("chat/completions") and param in ("best_of", "suffix"):
            continue
        r = post(srv, {**body, "max_tokens": 3, **extra}, path)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and err["code"] == code, err


# ---- logprobs, echo --------------------------------------------------------------------------


def test_completion_logprobs_streamed_and_not(client, model):
    """logprobs=N: the engine's logprobs (from the verify passes) of every token in the text, with
    N alternatives; the stream's pieces join to the same object."""
    ref = direct(model, PROMPT, max_new_tokens=10, logprobs=2)
    tok = model.tokenizer
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-6)
    # {token text: logprob}: two ids with one text share an entry (OpenAI's shape)
    assert [max(d.values()) for d in lp.top_logprobs] == pytest.approx([e.top[0][1] for e in ref.logprobs], abs=1e-6)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens and values == pytest.approx(lp.token_logprobs, abs=1e-9)


def test_chat_logprobs_streamed_and_not(client, model):
    msgs = [{"role": "user", "content": PROMPT}]
    kw = dict(temperature=0.8, seed=5, top_p=0.9)
    ref = direct(model, PROMPT, max_new_tokens=8, chat=True, logprobs=3, **kw)
    shown = ref.logprobs  # every generated token, the EOS that ended it too (its text empty)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, logprobs=True, top_logprobs=3, **kw)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in shown], abs=1e-6)
    assert all(len(c.top_logprobs) <= 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-9 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, logprobs=True, top_logprobs=3,
                                                 stream=True, **kw))
    streamed = [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-9)


def test_echo_with_prompt_logprobs(srv, model):
    """lm-eval's local-completions: echo + logprobs gives the prompt's tokens with their
    log-probabilities (the first null), then the completion's; max_tokens 0 scores the prompt alone."""
    ids = model.encode(PROMPT)
    ref = model.prompt_logprobs(ids, top=1)
    for max_tokens in (0, 1):
        body = post(srv, {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}).json()
        c = body["choices"][0]
        lp = c["logprobs"]
        assert c["text"].startswith(PROMPT) and len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx([e.logprob for e in ref[1:]], abs=1e-6)
        assert body["usage"]["completion_tokens"] == max_tokens
    body = post(srv, {"prompt": PROMPT, "echo": True, "max_tokens": 3, "temperature": 0}).json()
    assert body["choices"][0]["text"] == PROMPT + direct(model, PROMPT, max_new_tokens=3).text
    body = post(srv, {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 2, "n": 2, "temperature": 0.8, "seed": 1}).json()
    for c in body["choices"]:
        assert c["text"].startswith(PROMPT) and c["logprobs"]["token_logprobs"][0] is None
        assert c["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx([e.logprob for e in ref[1:]], abs=1e-6)


# ---- processors, structured output ---------------------------------------------------------


def test_penalties_bias_min_p_through_the_client(client, model):
    opts = dict(presence_penalty=0.8, frequency_penalty=0.5)
    extra = dict(repetition_penalty=1.3, min_p=0.05)
    ids = model.encode(PROMPT)
    banned = direct(model, PROMPT, max_new_tokens=12).token_ids[0]
    bias = {banned: -100.0, 7: 3.0}
    for kw in (dict(temperature=0), dict(temperature=0.9, seed=4)):
        ref = direct(model, ids, max_new_tokens=12, logit_bias=bias, **opts, **extra, **kw)
        assert banned not in ref.token_ids
        r = client.completions.create(model=NAME, prompt=ids, max_tokens=12, logit_bias={str(k): v for k, v in bias.items()},
                                      extra_body=extra, **opts, **kw)
        assert r.choices[0].text == ref.text
        chunks = list(client.completions.create(model=NAME, prompt=ids, max_tokens=12, stream=True, extra_body=extra,
                                                logit_bias={str(k): v for k, v in bias.items()}, **opts, **kw))
        assert stream_texts(chunks) == {0: ref.text}


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "age"],
          "properties": {"name": {"type": "string", "maxLength": 5}, "kind": {"enum": ["cat", "dog"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_fifty_json_schema_requests_give_fifty_valid_documents(srv, client, model):
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    msgs = [{"role": "user", "content": "A pet as JSON"}]
    ref = direct(model, "A pet as JSON", max_new_tokens=100, chat=True, json_schema=SCHEMA, temperature=1.0, seed=0)
    texts = []
    for i in range(50):
        kw = dict(model=NAME, messages=msgs, max_tokens=100, temperature=1.0, seed=i, response_format=rf)
        if i % 5 == 4:
            texts.append(stream_texts(list(client.chat.completions.create(stream=True, **kw)), chat=True)[0])
        else:
            texts.append(client.chat.completions.create(**kw).choices[0].message.content)
    assert texts[0] == ref.text
    r = post(srv, {"messages": msgs, "max_tokens": 100, "temperature": 0, "response_format": rf}, "/v1/chat/completions")
    assert r.json()["selfspec"]["free_accepted"] > 0  # keys and separators the schema forces
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)
    assert len(set(texts)) > 10
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    r = post(srv, {"prompt": "Say", "max_tokens": 20, "temperature": 0.7, "seed": 1,
                               "response_format": {"type": "regex", "regex": "(yes|no), (cat|dog)"}})
    assert re.fullmatch("(yes|no), (cat|dog)", r.json()["choices"][0]["text"])


BAD_PROCESSING = [
    ({"logprobs": 21}, "logprobs", "invalid_value"),
    ({"logprobs": "2"}, "logprobs", "invalid_type"),
    ({"echo": "yes"}, "echo", "invalid_type"),
    ({"presence_penalty": 3}, "presence_penalty", "invalid_value"),
    ({"frequency_penalty": "x"}, "frequency_penalty", "invalid_type"),
    ({"repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
    ({"min_p": 1.5}, "min_p", "invalid_value"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "invalid_type"),
    ({"logit_bias": {"5": 200}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": [1]}, "logit_bias", "invalid_type"),
    ({"response_format": {"type": "xml"}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "invalid_type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": 5}}}},
     "response_format", "invalid_value"),
    ({"response_format": {"type": "regex", "regex": "(a"}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "grammar", "grammar": "start: nothing_here"}}, "response_format", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
]


@pytest.mark.parametrize("extra,param,code", BAD_PROCESSING)
def test_bad_processing_values_are_400(srv, extra, param, code):
    r = post(srv, {"prompt": "Hi", "max_tokens": 3, **extra})
    assert r.status_code == 400, (extra, r.text)
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err


def test_chat_top_logprobs_needs_logprobs(srv):
    r = post(srv, {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = post(srv, {"messages": [{"role": "user", "content": "Hi"}], "echo": True}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
