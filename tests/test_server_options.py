"""Issue 46: what OpenAI clients send, through the openai client against an in-process server
(the tiny random Llama of test_server): n choices, stop token ids, max_completion_tokens, and
every new field's validation (a 400 in OpenAI's shape naming the field, never a 500)."""

import json

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
