"""`selfspec serve`: the real server process on a free loopback port, driven by the official
openai client (streaming and not) and raw HTTP for the error cases; plus in-process servers
(uvicorn in a thread) for the scheduling properties, with an engine the test holds and
releases on events (never a sleep or a measured duration).

The model is a tiny random Llama with a byte-level BPE tokenizer built here, offline.
"""

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import torch  # noqa: E402

import selfspec  # noqa: E402
from selfspec.server.app import ServerSettings, create_app  # noqa: E402

from helpers import ar_generate  # noqa: E402

KEY = "test-key-123"
NAME = "tiny"
LOOPBACK = "127.0.0.1"
PROMPTS = ["Hello, world! How", "def f(x):\n    return", "Once upon a time there was"]
STRATEGY = {"strategy": "early-exit", "exit_layer": 2}
def subprocess_env() -> dict:
    """The environment of a server process: os.environ as it is when it starts (with the
    session's private costs directory, which a fixture sets after this module is imported:
    a copy taken at import sent servers' measured costs to the user's cache), plus these."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


# ---- fixtures ---------------------------------------------------------------------------


def build_tiny_model(out: Path, context: int = 512) -> Path:
    """A 4-layer random Llama (fp32, safetensors) + a byte-level BPE tokenizer with a chat
    template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = ["The quick brown fox jumps over the lazy dog. ", "def f(x):\n    return x * 2\n",
              "Hello, world! How are you today?", "Once upon a time there was a tiny model."] * 20
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=context, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def model(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and robust on a busy machine
    yield selfspec.load(str(tiny_dir), dtype="float32", device="cpu")
    torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _healthy(url: str, proc=None) -> bool:
    if proc is not None and proc.poll() is not None:
        raise AssertionError(f"server exited with {proc.returncode}")
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class ServerProcess:
    """`selfspec serve` in a subprocess. Port 0 by default: the server binds a free port itself
    and uvicorn logs which (no window in which another process can take it); Ray Serve needs
    a port chosen up front."""

    def __init__(self, args: list[str], log_path: Path, startup_timeout: float = 180, ready_line: str | None = None,
                 port: int = 0):
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "selfspec", "serve", *args, "--host", LOOPBACK, "--port", str(port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=subprocess_env(), start_new_session=True)
        try:
            if port == 0:
                port = int(wait_until(lambda: self._exited() or re.search(rf"running on http://{LOOPBACK}:(\d+)", self.log()),
                                      startup_timeout, "the server to bind a port").group(1))
            self.port = port
            self.url = f"http://{LOOPBACK}:{self.port}"
            wait_until(lambda: _healthy(self.url, self.proc) and (ready_line is None or ready_line in self.log()),
                       startup_timeout, "the server to start")
        except BaseException:
            self.stop()
            print(self.log())
            raise

    def log(self) -> str:
        return self.log_path.read_text()

    def _exited(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited with {self.proc.returncode}")
        return False

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    s = ServerProcess(
        ["--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu", "--strategy", "early-exit", "--exit-layer", "2",
         "--served-model-name", NAME, "--api-key", KEY, "--max-concurrency", "4", "--max-new-tokens-limit", "300",
         "--max-num-speculations", "8", "--allowed-strategies", "autoregressive,early-exit,prompt-lookup", "--threads", "1"],
        tmp_path_factory.mktemp("logs") / "server.log",
    )
    yield s
    s.stop()
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status reports it
    assert s.proc.returncode in (0, -signal.SIGTERM), s.log()[-3000:]
    assert "Traceback" not in s.log(), s.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def direct(model, prompt, max_new_tokens=40, **kw):
    kw = {"temperature": 0.0, **({} if "strategy" in kw else STRATEGY), **kw}
    return model.generate(prompt, max_new_tokens=max_new_tokens, **kw)


def post(server, path, body=None, key=KEY, raw=None, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers={**headers, "content-type": "application/json"}, timeout=30, **kw)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30, **kw)


def sse_events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


# ---- the real server process, openai client ----------------------------------------------


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    h = httpx.get(server.url + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["model"] == NAME


def test_completion_greedy_matches_direct_generation(server, client, model):
    for prompt in PROMPTS:
        ref = direct(model, prompt)
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
        # the arithmetic is part of the fingerprint: the server's process computes as this one does
        assert r.system_fingerprint.endswith("-" + model.runtime.numerics)
        assert r.usage.prompt_tokens == ref.prompt_tokens and r.usage.completion_tokens == len(ref.token_ids)
        stats = r.model_extra["selfspec"]
        assert stats["strategy"] == "early-exit" and stats["new_tokens"] == len(ref.token_ids)
        # greedy draft lengths are the batch planner's (selfspec.batch): the text equals solo
        # decoding, the draft counts need not
        assert 0 <= stats["accepted"] <= stats["drafted"] and stats["verify_steps"] >= 1
        for k in ("acceptance_rate", "mean_accepted_length", "verify_steps", "time_to_first_token_s", "queue_time_s"):
            assert k in stats


def test_greedy_matches_selfspec_generate_cli(server, client, tiny_dir):
    """The same prompt and strategy through `selfspec generate --json` (plain and --chat)."""
    base = [sys.executable, "-m", "selfspec", "generate", PROMPTS[0], "--model", str(tiny_dir), "--dtype", "float32",
            "--device", "cpu", "--strategy", "early-exit", "--exit-layer", "2", "--max-new-tokens", "40", "--temperature", "0",
            "--json"]
    procs = [subprocess.Popen(base + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
             for extra in ([], ["--chat"])]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0)
    assert r.choices[0].text == outs[0]["text"]
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=40, temperature=0)
    assert c.choices[0].message.content == outs[1]["text"]
    assert c.choices[0].message.role == "assistant"


def test_chat_matches_direct_and_multi_turn(client, model, tiny_dir):
    ref = direct(model, PROMPTS[1], chat=True)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=40, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.model_extra["selfspec"]["new_tokens"] == len(ref.token_ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}]
    ids = model.tokenizer.apply_chat_template(
        [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]} for m in msgs],
        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ref = direct(model, list(ids), max_new_tokens=20)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids)


def test_streaming_equals_non_streaming(client, model):
    for prompt in PROMPTS[:2]:
        ref = direct(model, prompt)
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == ref.text
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == ["length" if ref.finish_reason == "length" else "stop"]
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
        assert last.model_extra["selfspec"]["new_tokens"] == len(ref.token_ids)  # draft counts: the batch planner's
        assert all(c.usage is None for c in chunks[:-1])

        ref = direct(model, prompt, chat=True)
        chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=40,
                                                     temperature=0, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.text
        assert chunks[-1].usage.total_tokens == ref.prompt_tokens + len(ref.token_ids)
        assert "selfspec" in chunks[-1].model_extra

    # without include_usage: no usage chunk, and the raw stream ends with data: [DONE]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, stream=True))
    assert all(c.choices for c in chunks)


def test_raw_sse_format(server):
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                                              "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert r.text.endswith("data: [DONE]\n\n")
    objs = [json.loads(e) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" and o["id"] == objs[0]["id"] for o in objs)
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 8


def test_stop_strings_stream_and_plain_agree(client, model):
    """A stop string that spans tokens: the stream must not leak its first part."""
    full = direct(model, PROMPTS[0], max_new_tokens=40).text
    # candidates: substrings that start mid-text and span several characters
    stops = [full[i:i + 5] for i in (8, 14, 20) if len(full) >= i + 5]
    for stop in stops:
        ref = direct(model, PROMPTS[0], max_new_tokens=40, stop=[stop])
        r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop])
        assert r.choices[0].text == ref.text
        chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=stop, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        if ref.finish_reason == "stop":
            assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text


def test_stop_holdback_unit():
    """The engine holds back text that may still become a stop string; the server forwards
    the engine's deltas as they are (one holdback, so the two cannot disagree)."""
    from selfspec.config import GenerationConfig
    from selfspec.engine import _Output

    def hold(text, stops):
        return _Output(None, GenerationConfig(stop=stops), (), None)._stop_prefix_len(text)

    assert hold("abc", ("cd",)) == 1
    assert hold("abc", ("bcz", "q")) == 2
    assert hold("abc", ("xbc",)) == 0
    assert hold("abc", ("zz",)) == 0
    assert hold("", ("ab",)) == 0
    import selfspec.server.app as app

    assert not hasattr(app, "_stop_holdback")


def test_sampling_with_seed_is_reproducible_and_matches_direct(client, model):
    kw = dict(temperature=0.9, top_p=0.95, seed=1234)
    ref = direct(model, PROMPTS[2], max_new_tokens=30, top_k=50, **kw)
    outs = [client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=30, extra_body={"top_k": 50}, **kw)
            .choices[0].text for _ in range(2)]
    assert outs[0] == outs[1] == ref.text


def test_a_seed_is_one_text_and_the_fingerprint_names_the_rule(client, model):
    """Gumbel-max coupling (the default): a seeded request's text is seeded autoregressive
    sampling's, whatever strategy the request drafts with; 'selfspec.coupling' picks the rule
    per request, and system_fingerprint names it."""
    kw = dict(temperature=0.9, top_p=0.95, seed=77)
    for coupling in ("gumbel", "rejection"):  # rejection: the served draft's own text (direct: the same strategy)
        ref = (ar_generate if coupling == "gumbel" else direct)(model, PROMPTS[1], max_new_tokens=30, coupling=coupling, **kw)
        exts = [{"coupling": coupling}] + ([{"coupling": "gumbel", "strategy": "prompt-lookup"}, {"num_speculations": 6}]
                                           if coupling == "gumbel" else [])
        for ext in exts:
            r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=30, extra_body={"selfspec": ext}, **kw)
            assert r.choices[0].text == ref.text, ext
            assert r.system_fingerprint.endswith(f"-{coupling}-{model.runtime.numerics}")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="Hi", max_tokens=5, extra_body={"selfspec": {"coupling": "exact"}})
    assert "gumbel, rejection" in str(e.value)


def test_per_request_strategy_within_limits(client, model):
    ref = ar_generate(model, PROMPTS[0], max_new_tokens=40)
    for ext in ({"strategy": "prompt-lookup", "max_ngram": 2}, {"strategy": "autoregressive"},
                {"exit_layer": 3, "num_speculations": 8}):
        r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, extra_body={"selfspec": ext})
        assert r.choices[0].text == ref.text  # lossless: greedy output never depends on the draft
        stats = r.model_extra["selfspec"]
        assert stats["strategy"] == ext.get("strategy", "early-exit")
        for k, v in ext.items():
            assert stats["draft"][k] == v
    for ext, fragment in (({"num_speculations": 9}, "1..8"), ({"strategy": "layer-skip", "skip_mlp": [1]}, "not allowed"),
                          ({"strategy": "draft-model"}, "not allowed"), ({"draft_model": "/etc"}, "cannot be set per request"),
                          ({"exit_layer": 99}, "exit layer"), ({"num_speculations": "4"}, "integer"), ({"bogus": 1}, "bogus")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, prompt="Hi", max_tokens=5, extra_body={"selfspec": ext})
        assert fragment in str(e.value), (ext, str(e.value))


# ---- error answers: raw HTTP ------------------------------------------------------------

LONG = "The quick brown fox jumps over the lazy dog. " * 120  # > 512 tokens

ERROR_CASES = [
    # (path, raw body or JSON body, status, code)
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b"", 400, "invalid_json"),
    ("/v1/completions", [1, 2], 400, "invalid_json"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": "ten"}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": True}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "temperature": "hot"}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "temperature": 3}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "top_p": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "top_k": 1.5}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "seed": "x"}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "stop": 5}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "stream": "yes"}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "stream_options": {"include_usage": True}}, 400, None),
    ("/v1/completions", {"model": NAME, "prompt": 42}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": ["a", 5]}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": ["a", []]}, 400, "empty_prompt"),
    ("/v1/completions", {"model": NAME, "prompt": ["a"] * 20, "n": 16}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": [5, 99999]}, 400, "invalid_value"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "Hi"}, 404, "model_not_found"),
    ("/v1/completions", {"prompt": "Hi"}, 400, "missing_required_parameter"),
    ("/v1/completions", {"model": NAME}, 400, "missing_required_parameter"),
    ("/v1/completions", {"model": NAME, "prompt": ""}, 400, "empty_prompt"),
    ("/v1/completions", {"model": NAME, "prompt": "   \n"}, 400, "empty_prompt"),
    ("/v1/completions", {"model": NAME, "prompt": []}, 400, "empty_prompt"),
    ("/v1/completions", {"model": NAME, "prompt": LONG}, 400, "context_length_exceeded"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 301}, 400, "max_tokens_exceeded"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "n": 0}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "logprobs": 30}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "presence_penalty": 2.5}, 400, "invalid_value"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "best_of": 2}, 400, "unsupported_parameter"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "frobnicate": 1}, 400, "unrecognized_argument"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "selfspec": "fast"}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "selfspec": {"coupling": 1}}, 400, "invalid_type"),
    ("/v1/completions", {"model": NAME, "prompt": "Hi", "selfspec": {"coupling": "gumbal"}}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": NAME, "messages": "Hi"}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": NAME, "messages": []}, 400, "empty_prompt"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": ""}]}, 400, "empty_prompt"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": 5}]}, 400, "invalid_type"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "unsupported_parameter"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": LONG}]}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000},
     400, "max_tokens_exceeded"),
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "unsupported_parameter"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
]


def test_error_cases_use_openai_shape(server):
    for path, body, status, code in ERROR_CASES:
        r = post(server, path, raw=body) if isinstance(body, bytes) else post(server, path, body)
        assert r.status_code == status, (body if not isinstance(body, dict) or body.get("prompt") is not LONG else "LONG", r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if code is not None:
            assert err["code"] == code, (body, err)
    # the server is still up and still answers correctly
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert post(server, "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0}).status_code == 200


def test_defaults_and_extras_accepted(server):
    # no temperature (OpenAI default 1.0), null fields, off-valued unsupported fields, a batch of one, token ids
    for body in ({"model": NAME, "prompt": "Hi", "max_tokens": 3, "seed": 1},
                 {"model": NAME, "prompt": ["Hi"], "max_tokens": 3, "temperature": None, "top_p": None, "stop": None, "n": 1,
                  "logprobs": None, "echo": False, "presence_penalty": 0, "user": "me", "selfspec": {}},
                 {"model": str(server.proc.args[server.proc.args.index("--model") + 1]), "prompt": [5, 6, 7], "max_tokens": 3}):
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 3


def test_api_key(server, client):
    body = {"model": NAME, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models", timeout=10)
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="Hi", max_tokens=2)
    # health and metrics need no key
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_metrics_prometheus(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0)
    list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True))
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fam = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("selfspec_requests", "selfspec_generation_tokens", "selfspec_draft_tokens", "selfspec_accepted_draft_tokens",
                 "selfspec_acceptance_rate", "selfspec_mean_accepted_length", "selfspec_time_to_first_token_seconds",
                 "selfspec_time_per_output_token_seconds", "selfspec_request_latency_seconds", "selfspec_prompt_tokens"):
        assert name in fam, name

    def value(name, suffix="_total", **labels):
        return sum(s.value for s in fam[name].samples if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("selfspec_requests", endpoint="completions", status="200") >= 2
    assert value("selfspec_requests", status="400") >= 1
    assert value("selfspec_generation_tokens") >= 40
    drafted, accepted = value("selfspec_draft_tokens"), value("selfspec_accepted_draft_tokens")
    assert drafted > 0 and 0 <= accepted <= drafted
    assert value("selfspec_acceptance_rate", "") == pytest.approx(accepted / drafted)
    assert value("selfspec_mean_accepted_length", "") >= 1.0
    assert value("selfspec_time_to_first_token_seconds", "_count") >= 2
    assert value("selfspec_time_per_output_token_seconds", "_count") >= 2


def test_one_log_line_per_request(server):
    marker = f"/v1/log-marker-{time.time_ns()}"
    httpx.get(server.url + marker, timeout=10)
    post(server, "/v1/completions", {"model": NAME, "prompt": "Log me", "max_tokens": 4, "temperature": 0})
    lines = wait_until(lambda: [ln for ln in server.log().splitlines() if marker in ln], 60, "the log line")
    assert len(lines) == 1 and '" 404 ' in lines[0]
    # the access line is written after the response is sent: wait for it rather than race it
    lines = wait_until(lambda: [ln for ln in server.log().splitlines() if '"POST /v1/completions" 200' in ln and "completion=4 " in ln], 60, "the POST log line")
    assert re.search(r"prompt=\d+ completion=4 finish=length strategy=early-exit", lines[-1]), lines[-1]
    assert "Traceback" not in server.log()


def test_disconnect_mid_stream_frees_the_slot(server):
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        # leaving the block closes the connection mid-stream
    wait_until(lambda: httpx.get(server.url + "/health", timeout=30).json()["in_progress"] == 0, 60, "the slot to be freed")
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200


# ---- in-process servers: scheduling with a controlled engine speed ----------------------


class InProcessServer:
    """uvicorn in a thread, on a socket bound here (port 0: no window for another process)."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind((LOOPBACK, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{LOOPBACK}:{self.port}"
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.server.started, 60, "the in-process server")
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()


class HeldEngine:
    """Wraps the worker's hooks (instance attributes, restored on exit) so that the test
    decides when the engine thread moves: no step runs until `go` (a job that got its slot
    waits there), and, with `pause_after` = n, a job lets n tokens through and waits for `resume` before the
    next one (the whole engine thread waits: every sequence of the batch). Records the jobs in
    the order they entered, their prompts, the tokens each one got and the step each token
    came in (`steps[i]`), which job each delivered token belonged to (`decoded`), and the
    most jobs holding a slot at once."""

    def __init__(self, app, pause_after: int | None = None):
        self.worker = app.state.selfspec.worker
        self.go, self.resume = threading.Event(), threading.Event()
        self.go.set()
        self.pause_after = pause_after
        self.max_active = 0
        self.jobs: list = []
        self.entered: list = []
        self.steps: list[list[int]] = []
        self.decoded: list[int] = []  # index into `entered` of each token the server accepted
        self.lock = threading.Lock()

    @property
    def active(self) -> int:
        return self.worker.running

    @property
    def tokens(self) -> list[int]:
        """Tokens of each finished job (in finishing order is not kept: by entry order)."""
        return [len(s) for j, s in zip(self.jobs, self.steps) if j.finished]

    def __enter__(self):
        w = self.worker
        start, on_token, step = w.start, w.on_token, w.engine_step

        def held_start(job):
            with self.lock:
                self.jobs.append(job)
                self.entered.append(list(job.params.prompt_ids))
                self.steps.append([])
            start(job)

        def held_token(job, ev):
            me = self.jobs.index(job)
            self.steps[me].append(w.steps)
            if self.pause_after is not None and len(self.steps[me]) > self.pause_after:
                assert self.resume.wait(120), "the test never resumed the engine"
            on_token(job, ev)
            with self.lock:
                self.decoded.append(me)

        def counted_step():
            assert self.go.wait(120), "the test never let the engine start"
            self.max_active = max(self.max_active, w.running)
            step()

        w.start, w.on_token, w.engine_step = held_start, held_token, counted_step
        return self

    def __exit__(self, *exc):
        self.go.set()
        self.resume.set()
        del self.worker.start, self.worker.on_token, self.worker.engine_step


def _settings(**kw):
    return ServerSettings(**{"model_name": NAME, "max_new_tokens_limit": 400, **kw})


def raw_request(srv: InProcessServer, body: dict) -> socket.socket:
    """POST body on a raw connection and return it unread: closing it is a client going away
    at a moment the test chooses."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((LOOPBACK, srv.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_slots_in_arrival_order_at_most_max_batch(model):
    """Five requests, two slots: they enter the batch in arrival order, never more than two
    at once, and each output equals its solo generation."""
    app = create_app(model, model.draft_config(**STRATEGY), _settings(max_concurrency=8, max_batch=2))
    prompts = [f"{w} is here" for w in ("Alpha", "Bravo", "Charlie", "Delta", "Echo")]
    with HeldEngine(app) as eng, InProcessServer(app) as srv, concurrent.futures.ThreadPoolExecutor(5) as ex:
        eng.go.clear()  # the first request holds the engine until every request is queued

        def one(i):
            r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": prompts[i], "max_tokens": 30, "temperature": 0},
                           timeout=120)
            return r.status_code, r.json()

        futures = [ex.submit(one, 0)]
        wait_until(lambda: len(eng.entered) == 1, 60, "the first request to reach the engine")
        for i in range(1, 5):  # arrival order = index order: each is queued before the next is sent
            futures.append(ex.submit(one, i))
            wait_until(lambda: srv.health()["waiting"] == i, 60, f"request {i} to be queued")
        eng.go.set()
        results = [f.result(120) for f in futures]
        assert srv.health()["max_batch"] == 2
    assert [s for s, _ in results] == [200] * 5
    assert 1 <= eng.max_active <= 2
    assert eng.entered == [model.encode(p) for p in prompts]  # first come, first served
    for p, (_, body) in zip(prompts, results):
        assert body["choices"][0]["text"] == direct(model, p, max_new_tokens=30).text
    assert sorted(set(eng.decoded)) == list(range(5))


def test_overload_gets_429_at_once_and_queue_timeout_503(model):
    """With the engine held by the first request: a third request is refused without waiting
    for the engine, and the queued second one gets 503 after its 1 s queue timeout."""
    app = create_app(model, model.draft_config(**STRATEGY), _settings(max_concurrency=2, queue_timeout_s=1.0, max_batch=1))
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0}
    with HeldEngine(app) as eng, InProcessServer(app) as srv, concurrent.futures.ThreadPoolExecutor(2) as ex:
        eng.go.clear()
        first = ex.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=120)
        wait_until(lambda: len(eng.entered) == 1, 60, "the first request to reach the engine")
        second = ex.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=120)
        wait_until(lambda: srv.health()["in_progress"] == 2, 60, "the second request to be admitted")
        third = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert third.status_code == 429 and not eng.go.is_set()  # answered while the engine is held
        assert third.json()["error"]["code"] == "rate_limit_exceeded" and int(third.headers["Retry-After"]) >= 1
        r2 = second.result(120)  # the engine is still held: nothing can start it
        assert r2.status_code == 503 and r2.json()["error"]["code"] == "server_overloaded" and "Retry-After" in r2.headers
        assert not first.done()
        eng.go.set()
        assert first.result(120).status_code == 200
        m = httpx.get(srv.url + "/metrics", timeout=30).text
        assert 'selfspec_rejected_requests_total{reason="queue_full"} 1.0' in m
        assert 'selfspec_rejected_requests_total{reason="queue_timeout"} 1.0' in m
        ok = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 3}, timeout=120)
        assert ok.status_code == 200
    assert len(eng.entered) == 2  # the timed-out request never reached the engine


def test_client_disconnect_aborts_generation_at_once(model):
    """The engine is paused after a few tokens while the client goes away; once the server
    has noticed, the engine is resumed: the request gets no token from any later step (it
    leaves the batch at the step boundary) and its slot is freed."""
    app = create_app(model, model.draft_config(**STRATEGY), _settings(max_concurrency=4))
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0}
    events: list = []
    direct(model, PROMPTS[0], max_new_tokens=300, on_event=events.append)
    first_text = next(i for i, e in enumerate(events) if e.text) + 1  # tokens until the stream has a first chunk
    with HeldEngine(app, pause_after=first_text) as eng, InProcessServer(app) as srv:
        # mid-stream
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}) as r:
                assert next(r.iter_lines()).startswith("data: ")
        wait_until(lambda: srv.health()["in_progress"] == 0, 60, "the server to notice the disconnect")
        eng.resume.set()
        wait_until(lambda: eng.jobs[0].finished and srv.health()["running"] == 0, 60, "the engine to drop the request")
        # The engine may notice the disconnect before it reaches the pause (the request then
        # ends with the tokens the client already had) or while paused; either way no token
        # comes from a step after the one the disconnect happened in.
        assert len(eng.steps[0]) >= first_text
        assert len(set(eng.steps[0][first_text:])) <= 1  # at most the step in flight
        assert len(eng.steps[0]) < 300
        # non-streamed: the client goes away while its generation is paused after one token
        eng.resume.clear()
        eng.pause_after = 1
        gone = raw_request(srv, body)
        wait_until(lambda: len(eng.entered) == 2 and len(eng.steps[1]) == 2, 60, "the request to reach the engine")
        gone.close()
        wait_until(lambda: srv.health()["in_progress"] == 0, 60, "the server to notice the disconnect")
        eng.resume.set()
        wait_until(lambda: eng.jobs[1].finished, 60, "the engine to drop the request")
        assert set(eng.steps[1][1:]) == {eng.steps[1][1]} and len(eng.steps[1]) < 300
        # waiting in the queue, then gone: never reaches the engine
        eng.resume.clear()
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            long = ex.submit(httpx.post, srv.url + "/v1/completions", json={**body, "max_tokens": 60}, timeout=120)
            wait_until(lambda: len(eng.entered) == 3 and len(eng.steps[2]) == 2, 60, "the long request")
            queued = raw_request(srv, {**body, "prompt": "Queued"})
            wait_until(lambda: srv.health()["waiting"] == 1, 60, "the second request to be queued")
            queued.close()
            wait_until(lambda: srv.health()["in_progress"] == 1, 60, "the server to notice the queued client left")
            eng.resume.set()
            assert long.result(120).status_code == 200
        wait_until(lambda: srv.health()["waiting"] == 0, 60, "the engine thread to skip the abandoned job")
        assert len(eng.entered) == 3
        m = httpx.get(srv.url + "/metrics", timeout=30).text
        assert "selfspec_cancelled_generations_total 3.0" in m
        h = srv.health()
        assert h["in_progress"] == 0 and h["waiting"] == 0 and h["running"] == 0 and h["batch_size"] == 0


def test_engine_failure_is_answered_and_the_server_goes_on(model):
    """A request's own failure (here: streaming its first token) ends it alone; a failed
    batch step fails the requests in it, and a fresh engine serves the next ones."""
    app = create_app(model, model.draft_config(**STRATEGY), _settings())
    ref = direct(model, "Still alive", max_new_tokens=5).text
    worker = app.state.selfspec.worker
    on_token, step = worker.on_token, worker.engine_step
    fail_step = threading.Event()

    def failing(job, ev):
        if list(job.params.prompt_ids) == [5, 6]:  # only the marked requests fail, at their first token
            raise RuntimeError("boom")
        on_token(job, ev)

    def failing_step():
        if fail_step.is_set():
            fail_step.clear()
            raise RuntimeError("step boom")
        step()

    worker.on_token, worker.engine_step = failing, failing_step
    try:
        with InProcessServer(app) as srv:
            r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": [5, 6], "max_tokens": 5}, timeout=60)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "boom" in r.json()["error"]["message"]
            r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": [5, 6], "max_tokens": 5, "stream": True}, timeout=60)
            assert r.status_code == 500  # failed before its first token: still a proper status
            fail_step.set()
            r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 5}, timeout=60)
            assert r.status_code == 500 and "step boom" in r.json()["error"]["message"]
            r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "Still alive", "max_tokens": 5, "temperature": 0},
                           timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
            assert srv.health()["running"] == 0
    finally:
        del worker.on_token, worker.engine_step


def test_operator_limits_and_settings_validation(model):
    app = create_app(model, model.draft_config(**STRATEGY), _settings(allow_request_draft=False, max_stop=1, max_request_bytes=2000))
    with InProcessServer(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x" * 3000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "Hi", "selfspec": {"strategy": "autoregressive"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "selfspec"
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "Hi", "stop": ["a", "b"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
        r = httpx.get(srv.url + "/v1/models")  # no api key configured: open
        assert r.status_code == 200 and r.json()["data"][0]["max_model_len"] == model.context_length
    for bad in ({"max_concurrency": 0}, {"queue_timeout_s": 0}, {"allowed_strategies": ("warp",)}, {"max_num_speculations": 99}):
        with pytest.raises(selfspec.SelfSpecError):
            _settings(**bad)


def test_cli_rejects_bad_options_before_loading(tiny_dir):
    for args, fragment in ((["--max-concurrency", "0"], "max_concurrency"), (["--allowed-strategies", "warp"], "warp"),
                           (["--port", "70000"], "--port"), (["--coupling", "exact"], "coupling")):
        p = subprocess.run([sys.executable, "-m", "selfspec", "serve", "--model", str(tiny_dir), *args], capture_output=True,
                           text=True, env=subprocess_env(), timeout=60)
        assert p.returncode == 2 and fragment in p.stderr, p.stderr


# ---- Ray Serve: two replicas behind one endpoint -----------------------------------------


@pytest.mark.slow
def test_ray_serve_two_replicas(tiny_dir, model, tmp_path):
    pytest.importorskip("ray.serve", reason='Ray Serve is optional: pip install "ray[serve]"')
    s = ServerProcess(["--model", str(tiny_dir), "--dtype", "float32", "--device", "cpu", "--strategy", "early-exit",
                       "--exit-layer", "2", "--served-model-name", NAME, "--ray", "--replicas", "2", "--replica-cpus", "1",
                       "--threads", "1"],
                      tmp_path / "ray.log", startup_timeout=300, ready_line="with Ray Serve (2 replicas)", port=free_port())
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        refs = {p: direct(model, p, max_new_tokens=60).text for p in PROMPTS}
        replicas = set()

        def one(p):
            raw = client.completions.with_raw_response.create(model=NAME, prompt=p, max_tokens=60, temperature=0)
            return p, raw.headers.get("x-selfspec-replica"), raw.parse()

        for _ in range(5):  # bounded: routing is randomised, two rounds normally suffice
            with concurrent.futures.ThreadPoolExecutor(6) as ex:
                for p, rep, r in ex.map(one, PROMPTS * 2):
                    assert r.choices[0].text == refs[p]
                    assert r.model_extra["selfspec"]["replica"] == rep
                    replicas.add(rep)
            if len(replicas) >= 2:
                break
        assert len(replicas) == 2, replicas
        chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=60, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == refs[PROMPTS[0]]
        r = httpx.post(s.url + "/v1/completions", content=b"{bad", timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    finally:
        s.stop(signal.SIGINT, timeout=60)
    assert s.proc.returncode == 0, s.log()[-3000:]
