"""Server hardening (issue 18): nothing a client sends may stall everyone else.

(a) a huge body is refused by size before tokenizing, tokenization runs once and off the
    event loop; (b) a prompt-token limit, and a long prefill rides in the running stream's
    steps one chunk at a time (the batch engine's chunked prefill); (c) a draft option the strategy does not use is a 400; (d) one outcome per
    request in the log, /metrics and /health, and /health's `waiting` counts only clients
    still there. In-process servers, synchronised on events; the one time bound (0.5 s for
    /health) is the property under test.
"""

import json
import logging
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

import selfspec  # noqa: E402
from selfspec.config import DraftConfig  # noqa: E402
from selfspec.server.app import create_app  # noqa: E402
from selfspec.server.errors import APIError  # noqa: E402
from selfspec.server.parsing import ParseContext, encode, parse_request  # noqa: E402
from selfspec.server.settings import default_max_prompt_tokens  # noqa: E402

from helpers import ar_generate  # noqa: E402
from test_server import (  # noqa: E402
    NAME, PROMPTS, STRATEGY, subprocess_env, HeldEngine, InProcessServer, _settings, build_tiny_model, direct,
    raw_request, wait_until,
)

SENTENCE = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-limits") / "model")


@pytest.fixture(scope="module")
def model(tiny_dir):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield selfspec.load(str(tiny_dir), dtype="float32", device="cpu")
    torch.set_num_threads(threads)


class CountingTokenizer:
    """The model's tokenizer, counting calls and the threads they ran on."""

    def __init__(self, tok):
        self._tok = tok
        self.calls: list[tuple[int, str]] = []  # (characters, thread name)

    def __call__(self, text, *a, **kw):
        self.calls.append((len(text), threading.current_thread().name))
        return self._tok(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture
def counting(model):
    orig = model.tokenizer
    model.tokenizer = CountingTokenizer(orig)
    yield model.tokenizer
    model.tokenizer = orig


def timed_health(url: str) -> float:
    t0 = time.perf_counter()
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    return time.perf_counter() - t0


# ---- (a) large bodies ---------------------------------------------------------------------


def test_huge_body_is_refused_untokenized_while_health_answers(model, counting):
    app = create_app(model, model.draft_config(**STRATEGY), _settings())
    limits = app.state.selfspec.ctx.limits
    big = json.dumps({"model": NAME, "prompt": "word " * (1024 * 1024)}).encode()  # 5 MB
    assert len(big) > 5_000_000
    with InProcessServer(app) as srv:
        result: dict = {}

        def send():
            result["r"] = httpx.post(srv.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                                     timeout=120)

        t = threading.Thread(target=send)
        t.start()
        slowest = 0.0
        while t.is_alive():  # /health all the while the big body is read, parsed and refused
            slowest = max(slowest, timed_health(srv.url))
        t.join()
        slowest = max(slowest, timed_health(srv.url))
        r = result["r"]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert f"at most {limits.max_prompt_tokens}" in r.json()["error"]["message"] or "context length" in r.json()["error"]["message"]
        assert slowest < 0.5, slowest
        assert all(chars <= limits.max_prompt_chars for chars, _ in counting.calls)  # never tokenized
        # chat: the same bound over the messages' characters
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": NAME, "messages": [
            {"role": "user", "content": "x" * (limits.max_prompt_chars + 1)}]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert not counting.calls


def test_prompt_is_tokenized_once_off_the_event_loop(model, counting):
    app = create_app(model, model.draft_config(**STRATEGY), _settings())
    with InProcessServer(app) as srv:
        # over the context but under the character bound: tokenized once, then refused
        limits = app.state.selfspec.ctx.limits
        text = SENTENCE * (limits.max_prompt_chars // len(SENTENCE))
        assert len(model.tokenizer._tok(text).input_ids) > limits.max_prompt_tokens
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": text}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert len(counting.calls) == 1
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200
        assert len(counting.calls) == 2
    assert all(name.startswith("selfspec-tokenize") for _, name in counting.calls), counting.calls


def test_parsing_is_pure(model):
    """parse_request and encode work on plain dicts, without HTTP."""
    ctx = ParseContext.for_model(model, model.draft_config(**STRATEGY), _settings())
    req = parse_request({"model": NAME, "prompt": PROMPTS[0], "max_tokens": 7, "temperature": 0}, False, ctx)
    assert req.text == PROMPTS[0] and req.ids is None and req.max_tokens == 7
    params = encode(req, model, ctx)
    assert params.prompt_ids == model.encode(PROMPTS[0])
    with pytest.raises(APIError) as e:
        parse_request({"model": NAME, "prompt": "x" * (ctx.limits.max_prompt_chars + 1)}, False, ctx)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as e:
        parse_request({"model": NAME, "prompt": [5] * (ctx.limits.max_prompt_tokens + 1)}, False, ctx)
    assert e.value.code == "context_length_exceeded"


# ---- (b) prompt-token limit, chunked prefill -----------------------------------------------


def test_max_prompt_tokens(model):
    assert default_max_prompt_tokens(512, cpus=2) == 511
    assert default_max_prompt_tokens(32768, cpus=2) == 4096
    assert default_max_prompt_tokens(32768, cpus=64) == 32767
    app = create_app(model, model.draft_config(**STRATEGY), _settings(max_prompt_tokens=20))
    with InProcessServer(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": [5] * 21}, timeout=60)
        assert r.status_code == 400 and "at most 20 tokens" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": SENTENCE * 3}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": [5] * 20, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        assert srv.health()["max_prompt_tokens"] == 20


def test_cli_rejects_bad_prompt_limit(tiny_dir):
    p = subprocess.run([sys.executable, "-m", "selfspec", "serve", "--model", str(tiny_dir), "--max-prompt-tokens", "0"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert p.returncode == 2 and "max_prompt_tokens" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_long_prefill_yields_to_the_running_stream(model):
    """A streams; B (a ~450-token prompt) joins the batch and prefills 16 rows per step inside
    A's verify pass. A gets tokens in every step of B's prefill, /health answers while the
    engine is held with B's prefill mid-way, and both outputs equal plain decoding."""
    long_ids = model.encode(SENTENCE * 41)
    assert 400 < len(long_ids) < 500
    app = create_app(model, model.draft_config(**STRATEGY), _settings(prefill_chunk=16))
    worker = app.state.selfspec.worker
    log: list = []  # per step: (A's tokens so far, B's prompt rows in the cache)
    held, release = threading.Event(), threading.Event()
    step = worker.engine_step

    def logged():
        step()
        jobs = {len(j.params.prompt_ids) == len(long_ids): j for j in worker.slots}
        b = [s for s in worker.engine._active if True in jobs and s.handle is jobs[True].handle]
        if b and False in jobs:
            log.append((jobs[False].n_tokens, b[0].prefilled))
            if b[0].prefilled == 16 * 8 and not held.is_set():  # B's prefill mid-way: hold the engine
                held.set()
                assert release.wait(120)

    worker.engine_step = logged
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0, "stream": True}
    try:
        with InProcessServer(app) as srv, httpx.Client(timeout=120) as c:
            with c.stream("POST", srv.url + "/v1/completions", json=body) as a:
                lines = a.iter_lines()
                texts = [json.loads(next(lines)[6:])["choices"][0]["text"]]
                with concurrent_post(srv.url, {"model": NAME, "prompt": long_ids, "max_tokens": 8, "temperature": 0,
                                               "selfspec": STRATEGY}) as b:
                    assert held.wait(120)
                    assert timed_health(srv.url) < 0.5  # B's prefill is mid-way, the engine held
                    release.set()
                    texts += [json.loads(x[6:])["choices"][0]["text"] for x in lines if x.startswith("data: {")]
                    rb = b.result()
    finally:
        del worker.engine_step
    prefilling = [(n, p) for n, p in log if p < len(long_ids)]
    assert len(prefilling) >= len(long_ids) // 16 - 1, log  # chunked: 16 rows per step
    assert all(p2 - p1 <= 16 for (_, p1), (_, p2) in zip(prefilling, prefilling[1:])), log
    assert all(n2 > n1 for (n1, _), (n2, _) in zip(prefilling, prefilling[1:])), log  # A moved in every step
    assert "".join(texts) == direct(model, PROMPTS[0], max_new_tokens=300).text
    assert rb.status_code == 200, rb.text
    assert rb.json()["choices"][0]["text"] == ar_generate(model, long_ids, max_new_tokens=8).text


class concurrent_post:
    """POST in a thread; .result() waits for the response."""

    def __init__(self, url: str, body: dict):
        self.box: dict = {}
        self.t = threading.Thread(target=lambda: self.box.setdefault("r", httpx.post(url + "/v1/completions", json=body,
                                                                                     timeout=120)))

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.t.join(120)

    def result(self):
        self.t.join(120)
        return self.box["r"]


# ---- (c) unused options -------------------------------------------------------------------


def test_unused_draft_option_is_a_400(model):
    app = create_app(model, DraftConfig(), _settings())  # the default strategy: auto
    with InProcessServer(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "Hi", "selfspec": {"exit_layer": 999}},
                       timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == "selfspec.exit_layer" and "not used by the auto strategy" in err["message"]
        assert err["type"] == "invalid_request_error"
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2,
                                                        "selfspec": {"strategy": "autoregressive", "num_speculations": 3}},
                       timeout=60)
        assert r.status_code == 400 and "not used by the autoregressive strategy" in r.json()["error"]["message"]


# ---- (d) one outcome per request ------------------------------------------------------------


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_client_gone_is_one_outcome_everywhere(model):
    app = create_app(model, model.draft_config(**STRATEGY), _settings(max_concurrency=8))
    handler = Lines()
    logger = logging.getLogger("selfspec.server")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0}
    try:
        with HeldEngine(app, pause_after=1) as eng, InProcessServer(app) as srv, httpx.Client(timeout=120) as c:
            with c.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}) as r:
                lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
                assert r.status_code == 200 and next(lines).startswith("data: ")
                wait_until(lambda: len(eng.steps[0]) == 2, 60, "the engine to pause at the stream's second token")
                # two more requests queue behind the paused engine; their clients leave
                queued = [raw_request(srv, {**body, "prompt": f"Queued {i}"}) for i in range(2)]
                wait_until(lambda: srv.health()["waiting"] == 2, 60, "two queued requests")
                queued[1].close()  # the later one: still in the worker's queue
                wait_until(lambda: srv.health()["waiting"] == 1, 60, "/health to stop counting the gone client")
                queued[0].close()
                wait_until(lambda: srv.health()["waiting"] == 0, 60, "/health to stop counting the gone client")
            # the streamed client left mid-stream too
            wait_until(lambda: srv.health()["in_progress"] == 0, 60, "every slot to be freed")
            eng.resume.set()
            h = srv.health()
            m = httpx.get(srv.url + "/metrics", timeout=30).text
            lines = wait_until(lambda: [ln for ln in handler.lines if "POST /v1/completions" in ln and len(handler.lines) >= 3]
                               and [ln for ln in handler.lines if "POST /v1/completions" in ln], 60, "three log lines")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert h["outcomes"] == {"499": 3}, h
    assert 'selfspec_requests_total{endpoint="completions",status="499"} 3.0' in m
    assert 'status="200"' not in m
    assert "selfspec_cancelled_generations_total 3.0" in m
    assert len(lines) == 3 and all('" 499 ' in ln and "outcome=client-gone" in ln for ln in lines), lines
