"""What real clients send (issue 51): lm-evaluation-harness's `local-completions` against
`selfspec serve` (loglikelihood with an EOS next token, multiple choice, generate_until, batch
sizes 1 and 4), a list of prompts through the OpenAI SDK, one request's failure inside a
mixed batch, and logprobs' bytes and text offsets over byte-fallback tokens.

Tiny random models built here; nothing is downloaded (lm-eval reads the tokenizer from the
model's directory, HF_HUB_OFFLINE is set)."""

import concurrent.futures
import json

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import selfspec  # noqa: E402
from selfspec.drafters import EarlyExitDrafter, PromptLookupDrafter  # noqa: E402
from selfspec.server.app import create_app  # noqa: E402
from selfspec.server.logprob_format import CompletionLogprobs, token_bytes  # noqa: E402

from test_server import (  # noqa: E402
    NAME, STRATEGY, InProcessServer, ServerProcess, _settings, build_tiny_model, direct,
)

EOS = 1  # build_tiny_model's </s>
DOCS = ["The quick brown fox", "Hello, world! How are", "def f(x):\n    return", "Once upon a time there"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-clients") / "model")


@pytest.fixture(scope="module")
def model(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield selfspec.load(str(tiny_dir), dtype="float32", device="cpu")
    torch.set_num_threads(threads)


# ---- lm-evaluation-harness -------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_dir(tmp_path_factory):
    """The tiny model with its </s> row of the head made the greedy next token after DOCS[0]
    (the row of the token it would pick, scaled up): a document whose next token is EOS."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = build_tiny_model(tmp_path_factory.mktemp("tiny-eos") / "model")
    hf = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(out)(DOCS[0]).input_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
        top = int(logits.argmax())
        w = hf.lm_head.weight
        w[EOS] = w[top] * (1.1 if logits[top] > 0 else 0.9)  # EOS wins where that token would
    hf.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def eos_server(eos_dir, tmp_path_factory):
    s = ServerProcess(["--model", str(eos_dir), "--dtype", "float32", "--device", "cpu", "--strategy", "early-exit",
                       "--exit-layer", "2", "--served-model-name", NAME, "--threads", "1", "--max-new-tokens-limit", "64",
                       "--allowed-strategies", "early-exit"],
                      tmp_path_factory.mktemp("logs") / "eos-server.log")
    yield s
    s.stop()
    assert "Traceback" not in s.log(), s.log()[-3000:]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_local_completions(eos_server, eos_dir, batch_size, monkeypatch):
    """lm-eval's own LocalCompletionsAPI: loglikelihoods (multiple-choice continuations, and a
    whole document whose next token is EOS) equal the model's prompt logprobs in process, and
    its greedy generations equal generate."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model = selfspec.load(str(eos_dir), dtype="float32", device="cpu")
    lm = LocalCompletionsAPI(base_url=eos_server.url + "/v1/completions", model=NAME, tokenizer=str(eos_dir),
                             tokenizer_backend="huggingface", batch_size=batch_size, max_retries=1, max_length=256)
    pairs = [(DOCS[0], ""), (DOCS[1], " you"), (DOCS[1], " they"), (DOCS[2], " x"), (DOCS[3], " was a"), (DOCS[3], " is")]
    pairs[0] = (DOCS[0][:-4], DOCS[0][-4:])  # the document whose next token is EOS, as context + continuation
    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    for (ctx, cont), (score, _greedy) in zip(pairs, got):
        ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
        ref = model.prompt_logprobs(ctx_ids + cont_ids)
        assert score == pytest.approx(sum(e.logprob for e in ref[-len(cont_ids):]), abs=1e-4)
    ids = lm.tok_encode(DOCS[0])
    assert model.generate(ids, strategy="autoregressive", max_new_tokens=1, temperature=0).token_ids == [EOS]
    until = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    gens = lm.generate_until([Instance("generate_until", {}, (d, until), i) for i, d in enumerate(DOCS)], disable_tqdm=True)
    for doc, text in zip(DOCS, gens):
        ref = model.generate(lm.tok_encode(doc), strategy="autoregressive", max_new_tokens=12, temperature=0,
                             stop=["\n\n", "</s>"]).text
        assert text == ref


def test_eos_keeps_its_logprob_entry(model):
    """max_tokens 1, echo, logprobs, the next token forced to EOS: every prompt entry plus one
    for the EOS (empty text), plain and streamed."""
    app = create_app(model, model.draft_config(**STRATEGY), _settings())
    ids = model.encode(DOCS[1])
    body = {"model": NAME, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
            "logit_bias": {str(EOS): 100}}
    with InProcessServer(app) as srv:
        c = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["tokens"][-1] == "" and lp["token_logprobs"][-1] is not None
        assert c["finish_reason"] == "stop" and lp["text_offset"][-1] == len(c["text"])
        streamed = []
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and (x := json.loads(line[6:])["choices"][0]["logprobs"]):
                    streamed += x["token_logprobs"]
        assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-9)


# ---- a list of prompts ------------------------------------------------------------------------


def test_prompt_list_equals_prompts_one_by_one(model):
    """completions.create(prompt=[...]) with n=2 and logprobs, streamed and not: choice
    prompt * n + j equals choice j of that prompt sent alone; usage sums over all."""
    app = create_app(model, model.draft_config(**STRATEGY), _settings())
    prompts = [DOCS[0], model.encode(DOCS[1]), DOCS[2]]
    kw = dict(model=NAME, max_tokens=8, n=2, logprobs=2, temperature=0.9, seed=11)
    with InProcessServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        alone = [client.completions.create(prompt=p, **kw) for p in prompts]
        together = client.completions.create(prompt=prompts, **kw)
        chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw))
        greedy = client.completions.create(prompt=prompts, **{**kw, "temperature": 0})
    want = [(c.text, c.logprobs.token_logprobs, c.logprobs.tokens) for r in alone for c in r.choices]
    assert [c.index for c in together.choices] == list(range(6))
    assert [(c.text, c.logprobs.token_logprobs, c.logprobs.tokens) for c in together.choices] == want
    assert together.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert together.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    streamed = [("", [], []) for _ in range(6)]
    for ch in chunks:
        for c in ch.choices:
            t, v, k = streamed[c.index]
            lp = c.logprobs
            streamed[c.index] = (t + c.text, v + (lp.token_logprobs if lp else []), k + (lp.tokens if lp else []))
    assert streamed == want
    assert chunks[-1].usage.completion_tokens == together.usage.completion_tokens
    for i, p in enumerate(prompts):
        ref = direct(model, p, max_new_tokens=8).text
        assert [c.text for c in greedy.choices[2 * i: 2 * i + 2]] == [ref, ref]


# ---- one request's failure --------------------------------------------------------------------


def test_a_failing_request_ends_alone(model, monkeypatch):
    """16 requests decoding together (early exit, prompt lookup, plain, seeded sampling), 3 of
    them failing in their drafter or their processors mid-generation: 13 answers equal their
    solo runs, 3 clear errors, and the server goes on."""
    marks = {"Kilo": 3, "Lima": 5, "Mike": 2}  # prompt word -> the generated token after which it fails
    marked = {tuple(model.encode(f"{w} was here")): (w, n) for w, n in marks.items()}

    def failing(fn):
        def call(self, *args):
            step = next(a for a in args if hasattr(a, "tokens") and hasattr(a, "pos"))
            for prompt, (word, after) in marked.items():
                if tuple(step.tokens[:len(prompt)]) == prompt and len(step.tokens) > len(prompt) + after:
                    raise RuntimeError(f"drafter failed on {word}")
            return fn(self, *args)
        return call

    monkeypatch.setattr(EarlyExitDrafter, "_choose", failing(EarlyExitDrafter._choose))
    monkeypatch.setattr(PromptLookupDrafter, "draft", failing(PromptLookupDrafter.draft))
    words = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel", "India", "Juliet", "Kilo", "Lima",
             "Mike", "November", "Oscar", "Papa"]
    kinds = [({}, {}), ({"strategy": "prompt-lookup"}, {}), ({"strategy": "autoregressive"}, {}),
             ({}, {"temperature": 0.8, "seed": 7})]
    cases = [(w, *kinds[i % 4]) for i, w in enumerate(words)]
    # the failing ones draft whatever the batch planner decides: greedy and sampled prompt lookup
    # (its candidate is made every step), sampled early exit (its own K every step)
    cases[10] = ("Kilo", {"strategy": "prompt-lookup"}, {})
    cases[11] = ("Lima", {"strategy": "prompt-lookup"}, {"temperature": 0.8, "seed": 5})
    cases[12] = ("Mike", {}, {"temperature": 0.8, "seed": 3})
    app = create_app(model, model.draft_config(**STRATEGY), _settings(max_concurrency=16, max_batch=16))

    def one(case):
        word, draft, sampling = case
        body = {"model": NAME, "prompt": f"{word} was here", "max_tokens": 24, "temperature": 0, **sampling,
                **({"selfspec": draft} if draft else {})}
        return httpx.post(srv.url + "/v1/completions", json=body, timeout=120)

    with InProcessServer(app) as srv, concurrent.futures.ThreadPoolExecutor(16) as ex:
        answers = list(ex.map(one, cases))
        after = one(("Alpha", {}, {}))
        health = srv.health()
    for (word, draft, sampling), r in zip(cases, answers):
        if word in marks:
            err = r.json()["error"]
            assert r.status_code == 500 and f"drafter failed on {word}" in err["message"] and err["type"] == "server_error"
            continue
        assert r.status_code == 200, r.text
        kw = {**({**STRATEGY, **draft} if "strategy" not in draft else draft), "temperature": 0.0, **sampling}
        assert r.json()["choices"][0]["text"] == model.generate(f"{word} was here", max_new_tokens=24, **kw).text, word
    assert after.status_code == 200 and health["running"] == 0 and health["status"] == "ok"


# ---- logprobs' bytes and text offsets ---------------------------------------------------------


def byte_fallback_tokenizer():
    """A SentencePiece-style BPE (▁ for spaces, <0x..> byte fallback) over a few words: any other
    character is spelled in byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "h", "i", "▁h", "▁hi", "a", "b", "▁a", "▁ab"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "i"), ("▁", "a"), ("▁a", "b")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_logprob_bytes_and_text_offsets(model):
    """Byte-fallback tokens: each token's bytes are its own (a character split over three tokens
    is split over their bytes), and text_offset follows the decoded text, not each token
    decoded alone."""
    tok = byte_fallback_tokenizer()
    ids = tok("hi 中 ab").input_ids
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces == ["▁hi", "▁", "<0xE4>", "<0xB8>", "<0xAD>", "▁ab"]
    assert [token_bytes(tok, t) for t in ids] == [b" hi", b" ", b"\xe4", b"\xb8", b"\xad", b" ab"]
    assert b"".join(token_bytes(tok, t) for t in ids)[1:].decode() == tok.decode(ids)
    lp = CompletionLogprobs(tok, 0).prompt([None] * len(ids), ids, tok.decode(ids))
    text = tok.decode(ids)
    assert text == "hi 中 ab" and lp["text_offset"] == [0, 2, 3, 3, 3, 4]
    # a byte-level BPE (the tiny server model's): a token's characters stand for bytes
    assert b"".join(token_bytes(model.tokenizer, t) for t in model.encode("Hello, w\u00f6rld!")) == "Hello, w\u00f6rld!".encode()
    # through the server: chat logprobs' bytes, completions' offsets over the echoed prompt
    app = create_app(model, model.draft_config(**STRATEGY), _settings())
    prompt = "Hello, w\u00f6rld! How"
    with InProcessServer(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": prompt, "echo": True, "logprobs": 0,
                                                          "max_tokens": 6, "temperature": 0}, timeout=60).json()
        c = httpx.post(srv.url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                               "logprobs": True, "max_tokens": 6, "temperature": 0,
                                                               "logit_bias": {"0": -100, "2": -100}}, timeout=60).json()
    ch = r["choices"][0]
    offsets, n_prompt = ch["logprobs"]["text_offset"], len(model.encode(prompt))
    prompt_ids = model.encode(prompt)
    for i in range(1, n_prompt):
        assert offsets[i] == len(model.tokenizer.decode(prompt_ids[:i], skip_special_tokens=True).rstrip("\ufffd"))
    assert offsets[n_prompt] == len(prompt) and offsets == sorted(offsets)
    content = c["choices"][0]["logprobs"]["content"]
    got = bytes(b for e in content for b in e["bytes"])  # (an EOS that ended it: no bytes)
    assert got.decode("utf-8", errors="replace") == c["choices"][0]["message"]["content"]
