"""Issue 46: structured output (grammar.py, llguidance) exact under speculation.

- greedy speculative == autoregressive under each grammar kind (regex, Lark, JSON schema, any
  JSON object), on every architecture's tiny model, solo and in a batch; the output matches;
- seeded sampling with the Gumbel coupling: speculative == autoregressive;
- rollback: a matcher that saw drafts and then a commit of fewer tokens is where a matcher fed
  only the committed tokens is (masks and forced tokens alike);
- forced tokens are free drafts, always accepted where the grammar allows one token only.
(50 JSON-schema requests through the server: test_server_options.)
"""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

import selfspec
from selfspec.config import Grammar
from selfspec.errors import SelfSpecError
from selfspec.grammar import compile_grammar, grammar_matcher
from selfspec.json_schema import closed

from helpers import ARCHS, ar_generate, build_hf, random_adapter

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "owner"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "kind": {"enum": ["cat", "dog", "bird"]},
                         "owner": {"type": "object", "additionalProperties": False, "required": ["age", "city"],
                                   "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                  "city": {"enum": ["Paris", "Rome"]}}}}}
REGEX = r"(cat|dog) (sat|ran) on the (mat|hill)\."
LARK = 'start: "the " animal " is " color\nanimal: "cat" | "dog"\ncolor: "red" | "blue" | "green"'
GRAMMARS = {"regex": Grammar("regex", REGEX), "lark": Grammar("lark", LARK), "json_schema": Grammar("json_schema", json.dumps(SCHEMA)),
            "json_object": Grammar("json_object")}
STRATEGIES = (dict(strategy="early-exit", exit_layer=2), dict(strategy="layer-skip", skip_mlp=(1, 2)),
              dict(strategy="prompt-lookup"))


def bpe_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained here on a little JSON and prose (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [json.dumps({"name": "Bob", "kind": "dog", "owner": {"age": 42, "city": "Paris"}}),
              "the cat sat on the mat. the dog ran on the hill.", "the cat is red"] * 20
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


_models: dict = {}


def model_of(arch: str, tok):
    if arch not in _models:
        _models[arch] = selfspec.load(build_hf(arch, vocab_size=len(tok)), dtype="float32", tokenizer=tok)
    return _models[arch]


def matches(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "lark":
        return re.fullmatch(r"the (cat|dog) is (red|blue|green)", text) is not None
    doc = json.loads(text)
    if kind == "json_schema":
        jsonschema.validate(doc, SCHEMA)
    return isinstance(doc, dict)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_equals_autoregressive_under_each_grammar(tok, arch):
    m = model_of(arch, tok)
    prompt = tok("the cat").input_ids
    for kind, g in GRAMMARS.items():
        budget = 120 if kind != "json_object" else 24  # a random model's free-form object may not close
        ref = ar_generate(m, prompt, max_new_tokens=budget, grammar=g)
        if kind != "json_object":
            assert ref.finish_reason == "eos" and matches(kind, ref.text), (arch, kind, ref.text)
        for strat in STRATEGIES:
            out = m.generate(prompt, max_new_tokens=budget, grammar=g, **strat)
            assert out.token_ids == ref.token_ids, (arch, kind, strat)
        batch = m.generate_batch([prompt, tok("the dog").input_ids], max_new_tokens=budget, grammar=g, **STRATEGIES[0])
        assert batch[0].token_ids == ref.token_ids, (arch, kind, "batch")


def test_seeded_sampling_under_a_grammar_is_autoregressive_sampling(tok):
    m = model_of("llama", tok)
    prompt = tok("the dog").input_ids
    for kind in ("regex", "json_schema"):
        for seed in range(4):
            kw = dict(max_new_tokens=120, grammar=GRAMMARS[kind], temperature=1.0, seed=seed)
            ref = ar_generate(m, prompt, **kw)
            assert matches(kind, ref.text)
            for strat in STRATEGIES[:2]:
                assert m.generate(prompt, **strat, **kw).token_ids == ref.token_ids, (kind, seed, strat)


# Issue 51: every strategy x {greedy, seeded} x grammars that defeat drafting. "script": Greek
# letters, whose byte tokens no restricted draft head (the 64 most frequent tokens) holds, so a
# draft row under the mask has no support; "choice": an enum; "eos": the grammar ends after a
# token or two, so EOS is forced early.
MATRIX_GRAMMARS = {"script": Grammar("regex", "[αβγδεζ]{4}"), "json_schema": GRAMMARS["json_schema"],
                   "choice": Grammar("json_schema", json.dumps({"enum": ["cat", "dog", "bird"]})),
                   "eos": Grammar("regex", "ok")}


@pytest.fixture(scope="module")
def every_strategy(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("grammar-drafts")
    draft_dir = d / "draft-model"
    build_hf("llama", seed=5, num_layers=2, vocab_size=len(tok)).save_pretrained(draft_dir)
    restricted = dict(draft_vocab=64)
    return (dict(strategy="early-exit", exit_layer=2, **restricted), dict(strategy="layer-skip", skip_mlp=(1, 2), **restricted),
            dict(strategy="quantized", **restricted), dict(strategy="quantized", draft_bits=4, exit_layer=3),
            dict(strategy="exit-adapter", adapter=random_adapter(d / "adapter.pt"), **restricted),
            dict(strategy="draft-model", draft_model=str(draft_dir), **restricted), dict(strategy="prompt-lookup"),
            dict(strategy="early-exit", exit_layer=2, lookup_first=True), dict(strategy="auto", **restricted))


@pytest.mark.parametrize("mode", ("greedy", "seeded"))
def test_every_strategy_under_grammars_that_defeat_drafting_is_autoregressive(tok, every_strategy, mode):
    m = model_of("llama", tok)
    for kind, g in MATRIX_GRAMMARS.items():
        for prompt in (tok("the cat").input_ids, tok("{").input_ids):
            for seed in ((None,) if mode == "greedy" else (0, 1, 2)):
                kw = dict(max_new_tokens=48, grammar=g) | (dict(temperature=1.0, seed=seed) if seed is not None else {})
                ref = ar_generate(m, prompt, **kw)
                assert ref.finish_reason == "eos", (kind, ref.text)  # every grammar here ends
                if kind == "script":
                    assert re.fullmatch("[αβγδεζ]{4}", ref.text), ref.text
                for strat in every_strategy:
                    out = m.generate(prompt, **strat, **kw)
                    assert out.token_ids == ref.token_ids, (mode, kind, strat, seed)
                batch = m.generate_batch([prompt, tok("the dog").input_ids], **every_strategy[0], **kw)
                assert batch[0].token_ids == ref.token_ids, (mode, kind, "batch", seed)


def test_a_restricted_draft_head_with_no_allowed_token_drafts_nothing(tok):
    """Under a grammar whose next tokens are all outside the draft vocabulary, the drafter stops
    (no forbidden token is drafted, no sampling error): only the final EOS, which the draft head
    holds, may be drafted, and it is accepted."""
    m = model_of("llama", tok)
    prompt = tok("the cat").input_ids
    for samp in (dict(), dict(temperature=0.8, seed=1), dict(temperature=0.8, seed=1, coupling="rejection")):
        out = m.generate(prompt, max_new_tokens=24, grammar=MATRIX_GRAMMARS["script"], strategy="early-exit", exit_layer=2,
                         draft_vocab=64, **samp)
        assert re.fullmatch("[αβγδεζ]{4}", out.text), (samp, out.text)
        assert out.stats.drafted <= 1 and out.stats.accepted == out.stats.drafted, samp


def test_a_matcher_state_left_unreachable_is_reachable_again(tok):
    """A query past an invalid draft leaves the matcher at the valid prefix; the prefix itself,
    asked for next (a verify row after a draft row: the mask cache does not hold it yet), is a
    real state again, not the unreachable end-of-sequence mask."""
    m = model_of("llama", tok)
    g = GRAMMARS["regex"]
    text = ar_generate(m, tok("the cat").input_ids, max_new_tokens=40, grammar=g).token_ids[:-1]
    fresh = grammar_matcher(m, g)
    want = fresh.allowed(text[:2]).clone()
    a = grammar_matcher(m, g)
    bad = next(t for t in range(len(tok)) if not bool(want[t]))
    a.allowed(text[:2] + [bad])  # consumes text[:2], then stops at the invalid token
    assert not a.reachable
    got = a.allowed(text[:2])
    assert torch.equal(got, want) and a.reachable
    assert not torch.equal(got, a.eos)


def test_rollback_leaves_the_matcher_where_autoregressive_decoding_would(tok):
    m = model_of("llama", tok)
    g = GRAMMARS["json_schema"]
    text = m.generate(tok("the cat").input_ids, max_new_tokens=120, grammar=g, strategy="autoregressive").token_ids[:-1]
    assert len(text) > 12
    for committed, k in ((3, 4), (5, 2), (0, 8)):
        a = grammar_matcher(m, g)
        a.commit(text[:committed])
        drafts = text[committed : committed + k]
        for j in range(k + 1):  # drafting then verifying visit these states, back and forth
            a.allowed(drafts[:j])
        a.allowed([drafts[0], 0, drafts[1]])  # and an invalid draft (token 0, <s>) with a row past it
        a.allowed(drafts[:3])
        keep = committed + 2
        a.commit(text[committed:keep])
        b = grammar_matcher(m, g)
        b.commit(text[:keep])
        for j in range(keep, len(text)):
            assert torch.equal(a.allowed(text[keep:j]), b.allowed(text[keep:j])), (committed, j)
        assert a.forced(8) == b.forced(8)
        assert a.m.compute_ff_bytes() == b.m.compute_ff_bytes()


def test_forced_tokens_are_free_drafts(tok):
    """Keys and punctuation the schema forces are drafted without the drafter, and the tokens the
    grammar allows alone are always accepted."""
    m = model_of("llama", tok)
    prompt = tok("the cat").input_ids
    ref = ar_generate(m, prompt, max_new_tokens=120, grammar=GRAMMARS["json_schema"])
    out = m.generate(prompt, max_new_tokens=120, grammar=GRAMMARS["json_schema"], strategy="early-exit", exit_layer=2)
    assert out.token_ids == ref.token_ids
    s = out.stats
    assert s.free_accepted > 0 and s.free_drafted >= s.free_accepted
    assert ref.stats.free_drafted == 0  # autoregressive decoding drafts nothing, not even forced tokens
    matcher = grammar_matcher(m, GRAMMARS["json_schema"])
    chain, certain = matcher.forced(16)
    assert certain >= 1 and all(int(matcher.allowed(chain[:i]).sum()) == 1 for i in range(certain))


def test_bad_grammars_are_one_line_errors(tok):
    for g in (Grammar("json_schema", "{not json"), Grammar("json_schema", "[1]"), Grammar("regex", "(a"),
              Grammar("lark", "start: missing_rule")):
        with pytest.raises(SelfSpecError) as e:
            compile_grammar(g)
        assert "\n" not in str(e.value)
    with pytest.raises(SelfSpecError):
        Grammar("yaml", "x")


# ---- JSON schemas are closed by default (json_schema.py) ---------------------------------------------

PERSON = {"type": "object", "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "color": {"enum": ["red", "blue"]}}}
NAMED = '{"name": "Bo", "age": 10, "color": "red"'


def takes(tok, schema, text: str, whole: bool = True) -> bool:
    """Whether the grammar compiled from schema takes text (whole: and may end there)."""
    ll = llguidance.hf.from_tokenizer(tok)
    m = llguidance.LLMatcher(ll, compile_grammar(Grammar("json_schema", json.dumps(schema))))
    ids = ll.tokenize_str(text)
    if m.validate_tokens(ids) < len(ids):
        return False
    m.consume_tokens(ids)
    return m.is_accepting() or not whole


def test_a_schema_that_names_its_properties_gets_no_others(tok):
    assert takes(tok, PERSON, NAMED + "}")
    assert not takes(tok, PERSON, NAMED + ', "gender"', whole=False)  # was: key after key until max_tokens
    assert takes(tok, PERSON, '{"name": "Bo", "color": "red"}') is False  # required ones stay required
    assert takes(tok, dict(PERSON, additionalProperties=True), NAMED + ', "gender": "x"}')
    assert takes(tok, dict(PERSON, additionalProperties={"type": "integer"}), NAMED + ', "n": 1}')
    assert not takes(tok, dict(PERSON, additionalProperties={"type": "integer"}), NAMED + ', "n": "x"', whole=False)
    assert takes(tok, {"type": "object"}, '{"anything": [1, 2]}')  # no properties named: any object


def test_closed_reaches_every_subschema(tok):
    extra = ', "x": 1'
    nested = {"type": "object", "required": ["p"], "properties": {"p": PERSON}}
    assert takes(tok, nested, '{"p": ' + NAMED + "}}") and not takes(tok, nested, '{"p": ' + NAMED + extra, whole=False)
    by_ref = {"$defs": {"P": PERSON}, "type": "array", "items": {"$ref": "#/$defs/P"}}
    assert takes(tok, by_ref, "[" + NAMED + "}]") and not takes(tok, by_ref, "[" + NAMED + extra, whole=False)
    either = {"anyOf": [PERSON, {"type": "string"}]}
    assert takes(tok, either, NAMED + "}") and not takes(tok, either, NAMED + extra, whole=False)
    # allOf branches are intersected: each names the other's keys, so the union is what is closed
    a = {"properties": {"a": {"type": "integer"}}, "required": ["a"]}
    b = {"properties": {"b": {"type": "integer"}}, "required": ["b"]}
    assert takes(tok, {"allOf": [a, b]}, '{"a": 1, "b": 2}')
    assert not takes(tok, {"allOf": [a, b]}, '{"a": 1, "b": 2' + extra, whole=False)
    # tuples: no items past those named, unless items says what they are
    pair = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}]}
    assert takes(tok, pair, "[1, 2]") and not takes(tok, pair, "[1, 2, 3", whole=False)
    assert takes(tok, dict(pair, items={"type": "integer"}), "[1, 2, 3]")
    schema = {"allOf": [a, b], "$defs": {"P": PERSON}}
    assert closed(schema) != schema and "additionalProperties" not in PERSON  # a copy: the caller's schema is kept


def test_a_generation_under_an_open_schema_stops_after_the_named_keys(tok):
    m = model_of("llama", tok)
    out = m.generate(tok("the cat").input_ids, max_new_tokens=120, grammar=Grammar("json_schema", json.dumps(PERSON)),
                     strategy="autoregressive")
    assert out.finish_reason == "eos" and list(json.loads(out.text)) == ["name", "age", "color"], out.text
