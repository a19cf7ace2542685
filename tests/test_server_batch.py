"""The batching server (issue 17): requests decode together in one continuous batch.

Per-request outputs equal solo generation at 1, 4 and 8 concurrent clients (greedy and
seeded sampling, streamed and not, batchable strategies and one the engine runs solo); a
client leaving mid-stream frees its slot for a waiting request while the others go on; the
batch never holds more than --max-batch sequences. In-process servers; the engine is held
and released on events, never on timing.
"""

import concurrent.futures
import json
import subprocess
import sys
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

import selfspec  # noqa: E402
from selfspec.server.app import create_app  # noqa: E402
from selfspec.server.settings import default_max_batch  # noqa: E402

from test_server import (  # noqa: E402
    NAME, STRATEGY, subprocess_env, HeldEngine, InProcessServer, _settings, build_tiny_model, direct, wait_until,
)

WORDS = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel")
# (selfspec options, sampling) per client: batchable strategies, one the engine runs solo
# (auto without a profile calibrates on its own prefill), and seeded sampling
MIX = [({}, {}), ({"strategy": "prompt-lookup"}, {}), ({"strategy": "autoregressive"}, {}), ({}, {"temperature": 0.8, "seed": 7}),
       ({"strategy": "auto"}, {}), ({"exit_layer": 3}, {}), ({"strategy": "prompt-lookup"}, {"temperature": 0.9, "seed": 3}),
       ({}, {})]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-batch") / "model")


@pytest.fixture(scope="module")
def model(tiny_dir):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield selfspec.load(str(tiny_dir), dtype="float32", device="cpu")
    torch.set_num_threads(threads)


def complete(url: str, body: dict) -> str:
    """The text of one completion, streamed (SSE deltas joined) or not."""
    if not body.get("stream"):
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def reference(model, prompt: str, draft: dict, sampling: dict, n: int) -> str:
    kw = {"temperature": 0.0, **sampling}
    return direct(model, prompt, max_new_tokens=n, **({**STRATEGY, **draft} if "strategy" not in draft else draft), **kw).text


def held_queue(srv, eng, bodies: list[dict], ex) -> list:
    """Send every body while the engine is held (the first gets a slot, the rest queue in
    order), then let the engine go: the others join the batch one step after the first."""
    eng.go.clear()
    futures = [ex.submit(complete, srv.url, bodies[0])]
    wait_until(lambda: len(eng.entered) == 1, 60, "the first request to reach the engine")
    for i, b in enumerate(bodies[1:], 1):
        futures.append(ex.submit(complete, srv.url, b))
        wait_until(lambda: srv.health()["waiting"] == i, 60, f"request {i} to be queued")
    eng.go.set()
    return [f.result(120) for f in futures]


@pytest.mark.parametrize("clients", [1, 4, 8])
def test_outputs_equal_solo_generation(model, clients):
    app = create_app(model, model.draft_config(**STRATEGY), _settings(max_concurrency=16, max_batch=8))
    bodies, refs = [], []
    for i in range(clients):
        draft, sampling = MIX[i]
        prompt = f"{WORDS[i]} said that"
        body = {"model": NAME, "prompt": prompt, "max_tokens": 24 + 4 * i, "temperature": 0, "stream": i % 2 == 1, **sampling}
        if draft:
            body["selfspec"] = draft
        bodies.append(body)
        refs.append(reference(model, prompt, draft, sampling, body["max_tokens"]))
    with HeldEngine(app) as eng, InProcessServer(app) as srv, concurrent.futures.ThreadPoolExecutor(clients) as ex:
        texts = held_queue(srv, eng, bodies, ex)
        h = srv.health()
    assert texts == refs
    assert eng.max_active == clients  # all of them decoded in one batch
    assert h["running"] == 0 and h["batch_size"] == 0 and h["waiting"] == 0


def test_client_leaving_mid_stream_frees_its_slot(model):
    """Two slots: A and B stream, C waits. B's client leaves while the engine is held at B's
    second token; C takes B's slot at the next step boundary and decodes alongside A; A and C
    equal their solo outputs."""
    app = create_app(model, model.draft_config(**STRATEGY), _settings(max_concurrency=8, max_batch=2))
    worker = app.state.selfspec.worker
    prompts = {"A": "Alpha goes on", "B": "Bravo leaves", "C": "Charlie waits"}
    at_b2, b_gone = threading.Event(), threading.Event()
    b_tokens = []
    with HeldEngine(app) as eng, InProcessServer(app) as srv, concurrent.futures.ThreadPoolExecutor(2) as ex:
        on_token = worker.on_token  # HeldEngine's recording hook

        def hold_b(job, ev):
            if job.params.prompt_ids == model.encode(prompts["B"]):
                b_tokens.append(ev)
                if len(b_tokens) == 2:
                    at_b2.set()
                    assert b_gone.wait(120)
            on_token(job, ev)

        worker.on_token = hold_b
        a = ex.submit(complete, srv.url, {"model": NAME, "prompt": prompts["A"], "max_tokens": 200, "temperature": 0, "stream": True})
        wait_until(lambda: len(eng.entered) == 1, 60, "A to enter")
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", srv.url + "/v1/completions",
                          json={"model": NAME, "prompt": prompts["B"], "max_tokens": 200, "temperature": 0, "stream": True}) as rb:
                lines = rb.iter_lines()
                assert next(lines).startswith("data: ")
                assert at_b2.wait(120)  # the engine is held inside a step
                cfut = ex.submit(complete, srv.url, {"model": NAME, "prompt": prompts["C"], "max_tokens": 30, "temperature": 0})
                wait_until(lambda: srv.health()["waiting"] == 1, 60, "C to wait for a slot")
        wait_until(lambda: srv.health()["in_progress"] == 2, 60, "the server to notice B left")
        b_gone.set()
        text_c, text_a = cfut.result(120), a.result(120)
    assert eng.entered == [model.encode(prompts[k]) for k in "ABC"]
    a_steps, b_steps, c_steps = eng.steps
    assert max(b_steps) == b_steps[1]  # B got nothing after the step it left in
    assert set(a_steps) & set(c_steps), "C decoded alongside A (it took B's slot while A ran)"
    assert text_a == direct(model, prompts["A"], max_new_tokens=200).text
    assert text_c == direct(model, prompts["C"], max_new_tokens=30).text


def test_max_batch_is_respected(model):
    """Seven requests, --max-batch 3: no step ever has more than three sequences, three run
    together, and the metrics show the queue while the engine is held."""
    app = create_app(model, model.draft_config(**STRATEGY), _settings(max_concurrency=16, max_batch=3))
    engine = app.state.selfspec.worker.engine
    admit, sizes = engine._admit, []

    def counted_admit():
        admit()
        sizes.append(len(engine._active))

    engine._admit = counted_admit
    bodies = [{"model": NAME, "prompt": f"{w} counts", "max_tokens": 20, "temperature": 0, "stream": i % 2 == 0}
              for i, w in enumerate(WORDS[:7])]
    with HeldEngine(app) as eng, InProcessServer(app) as srv, concurrent.futures.ThreadPoolExecutor(7) as ex:
        eng.go.clear()
        futures = [ex.submit(complete, srv.url, bodies[0])]
        wait_until(lambda: len(eng.entered) == 1, 60, "the first request to reach the engine")
        for i, b in enumerate(bodies[1:], 1):
            futures.append(ex.submit(complete, srv.url, b))
            wait_until(lambda: srv.health()["waiting"] == i, 60, f"request {i} to be queued")
        m = httpx.get(srv.url + "/metrics", timeout=30).text
        assert "selfspec_queue_depth 6.0" in m and "selfspec_max_batch 3.0" in m and "selfspec_batch_size" in m
        assert "selfspec_longest_stall_seconds" in m
        eng.go.set()
        texts = [f.result(120) for f in futures]
    assert max(sizes) == 3 and eng.max_active == 3
    assert texts == [direct(model, b["prompt"], max_new_tokens=20).text for b in bodies]


def test_cli_max_batch(tiny_dir):
    p = subprocess.run([sys.executable, "-m", "selfspec", "serve", "--help"], capture_output=True, text=True, env=subprocess_env(),
                       timeout=60)
    assert p.returncode == 0 and "--max-batch" in p.stdout and "4 per CPU core" in p.stdout
    p = subprocess.run([sys.executable, "-m", "selfspec", "serve", "--model", str(tiny_dir), "--max-batch", "0"],
                       capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert p.returncode == 2 and "max_batch" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert default_max_batch(1) == 4 and default_max_batch(2) == 8 and default_max_batch(64) == 32
