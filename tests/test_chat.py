"""Chat templates: the tokenizer's own, `--chat-template FILE|NAME` / `chat_template=`, and the
built-in template of a model's family for tokenizers without one (the default Gemma 3 270M is
a base model and its GGUF carries none). Through the API, `selfspec generate --chat` and the
server's /v1/chat/completions with the official openai client; on tiny models and (slow) on
the default model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import selfspec
from selfspec import chat_templates
from selfspec.errors import SelfSpecError

from helpers import VOCAB, build_hf, word_tokenizer
from test_cli import assert_user_error, run_cli

CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "sat on the mat"}, {"role": "user", "content": "and the dog"}]


def chatml_tokenizer():
    """The word tokenizer plus ChatML's two turn tokens (ids VOCAB and VOCAB + 1), no template."""
    tok = word_tokenizer(VOCAB, eos=True)
    tok.add_tokens(CHATML_TOKENS, special_tokens=True)
    return tok


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose tokenizer has no chat template and no turn tokens."""
    d = tmp_path_factory.mktemp("chat") / "plain"
    d.mkdir()
    build_hf("llama", seed=0).save_pretrained(d)
    word_tokenizer(VOCAB, eos=True).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 whose tokenizer has ChatML's turn tokens but no template: a base model."""
    d = tmp_path_factory.mktemp("chat") / "qwen"
    d.mkdir()
    build_hf("qwen2", seed=1, vocab_size=VOCAB + 2).save_pretrained(d)
    chatml_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("tpl") / "turns.jinja"
    p.write_text("{% for m in messages %}{% if m['role'] == 'user' %}he{% else %}she{% endif %} saw {{ m['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}she saw{% endif %}")  # words the word tokenizer knows
    return p


# ---- resolving --chat-template --------------------------------------------------------------


def test_resolve_names_files_and_strings(template_file):
    for name in ("gemma", "llama3", "chatml", "llama2", "mistral"):
        text, builtin, _ = chat_templates.resolve(name)
        assert builtin == name and text == chat_templates.BUILTIN[name]
    assert chat_templates.resolve("qwen")[1] == "chatml" and chat_templates.resolve("Gemma")[1] == "gemma"
    text, builtin, source = chat_templates.resolve(str(template_file))
    assert text == template_file.read_text() and builtin is None and str(template_file) in source
    assert chat_templates.resolve("{{ messages[0]['content'] }}")[0] == "{{ messages[0]['content'] }}"


@pytest.mark.parametrize("value, fragments", [
    ("gema", ("unknown chat template 'gema'", "did you mean gemma?")),
    ("nothing-like-it", ("unknown chat template", "chatml", "Jinja file")),
    ("templates/missing.jinja", ("chat template file not found: templates/missing.jinja",)),
    ("{% for m in messages %}", ("not a valid Jinja template",)),
])
def test_resolve_errors_are_one_line(value, fragments):
    with pytest.raises(SelfSpecError) as e:
        chat_templates.resolve(value)
    assert "\n" not in str(e.value)
    for f in fragments:
        assert f in str(e.value)


def test_builtin_templates_render_each_family_format():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def render(name, messages):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
        return env.from_string(chat_templates.BUILTIN[name]).render(messages=messages, add_generation_prompt=True,
                                                                      bos_token="<s>", eos_token="</s>")

    user = [{"role": "user", "content": "Hi"}]
    assert render("gemma", user) == "<s><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert render("gemma", [{"role": "system", "content": "Be brief."}, *user]) == (
        "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert render("llama3", user) == ("<s><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                                      "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render("chatml", user) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render("llama2", user) == "<s>[INST] Hi [/INST]"
    assert render("mistral", user) == "<s>[INST] Hi [/INST]"
    with pytest.raises(ValueError, match="alternate"):
        render("gemma", [*user, *user])


# ---- the API --------------------------------------------------------------------------------


def test_family_template_is_used_when_the_tokenizer_has_none(qwen_dir, caplog):
    m = selfspec.load(str(qwen_dir), dtype="float32", device="cpu")
    assert m.chat_template == chat_templates.BUILTIN["chatml"] and "chatml" in m.chat_template_source
    im_end = m.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in m.eos_token_ids  # the end of the assistant's turn ends generation
    expected = m.tokenizer.apply_chat_template([{"role": "user", "content": "the cat"}], chat_template=chat_templates.BUILTIN["chatml"],
                                               add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    with caplog.at_level(logging.WARNING, logger="selfspec"):
        assert m.encode("the cat", chat=True) == list(expected)
        m.encode("the dog", chat=True)
    notes = [r.getMessage() for r in caplog.records if "chat" in r.getMessage()]
    assert len(notes) == 1 and "no chat template of its own" in notes[0] and "chatml" in notes[0]  # said once
    ar = m.generate(MESSAGES, chat=True, max_new_tokens=16, strategy="autoregressive")
    ee = m.generate(MESSAGES, chat=True, max_new_tokens=16, strategy="early-exit", exit_layer=2, num_speculations=3)
    assert ee.token_ids == ar.token_ids and ar.prompt_tokens == len(m.encode(MESSAGES, chat=True))


def test_no_template_and_no_family_template_is_a_clear_error(plain_dir, template_file):
    m = selfspec.load(str(plain_dir), dtype="float32", device="cpu")
    assert m.chat_template is None
    with pytest.raises(SelfSpecError, match="no chat template.*--chat-template FILE\\|NAME"):
        m.generate("the cat", chat=True, max_new_tokens=4, strategy="autoregressive")
    assert m.generate("the cat", max_new_tokens=4, strategy="autoregressive").token_ids  # plain completion still works

    m.set_chat_template(str(template_file))
    ids = m.encode([{"role": "user", "content": "the cat"}], chat=True)
    assert m.tokenizer.decode(ids) == "he saw the cat she saw"
    with_file = selfspec.load(str(plain_dir), dtype="float32", device="cpu", chat_template=str(template_file))
    assert with_file.encode("the cat", chat=True) == ids
    with pytest.raises(SelfSpecError, match="unknown chat template"):
        selfspec.load(str(plain_dir), chat_template="chatm")


def test_a_template_that_rejects_the_messages_is_one_line(plain_dir):
    m = selfspec.load(str(plain_dir), dtype="float32", device="cpu", chat_template="gemma")
    with pytest.raises(SelfSpecError, match="the chat template rejected the messages: Conversation roles must alternate"):
        m.generate([{"role": "user", "content": "the cat"}, {"role": "user", "content": "the dog"}], chat=True, strategy="autoregressive")


def test_an_explicit_template_overrides_the_tokenizers_own(tmp_path, template_file):
    d = tmp_path / "own"
    d.mkdir()
    build_hf("llama", seed=0).save_pretrained(d)
    tok = word_tokenizer(VOCAB, eos=True)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(d)
    m = selfspec.load(str(d), dtype="float32", device="cpu")
    assert m.chat_template_source == "the tokenizer's chat template"
    assert m.tokenizer.decode(m.encode("the cat", chat=True)) == "the cat"
    m.set_chat_template(str(template_file))
    assert m.tokenizer.decode(m.encode("the cat", chat=True)) == "he saw the cat she saw"


# ---- the command line -----------------------------------------------------------------------


def _gen(model_dir, *args):
    return run_cli("generate", "the cat", "--model", str(model_dir), "--dtype", "float32", "--device", "cpu",
                   "--max-new-tokens", "8", "--json", *args)


def test_generate_chat_template_flag(plain_dir, template_file):
    r = _gen(plain_dir, "--chat-template", str(template_file))  # naming a template asks for chat
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    m = selfspec.load(str(plain_dir), dtype="float32", device="cpu", chat_template=str(template_file))
    ref = m.generate("the cat", chat=True, max_new_tokens=8, strategy="autoregressive")
    assert out["token_ids"] == ref.token_ids and out["prompt_tokens"] == ref.prompt_tokens
    r = _gen(plain_dir, "--chat", "--chat-template", "chatml")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == len(m.tokenizer.apply_chat_template(
        [{"role": "user", "content": "the cat"}], chat_template=chat_templates.BUILTIN["chatml"], add_generation_prompt=True,
        tokenize=True, return_dict=False))


def test_generate_chat_uses_the_family_template(qwen_dir):
    r = _gen(qwen_dir, "--chat", "--strategy", "early-exit", "--exit-layer", "2")
    assert r.returncode == 0, r.stderr
    m = selfspec.load(str(qwen_dir), dtype="float32", device="cpu")
    assert json.loads(r.stdout)["token_ids"] == m.generate("the cat", chat=True, max_new_tokens=8, strategy="autoregressive").token_ids
    assert r.stderr.count("chat prompts use the built-in chatml") == 1


@pytest.mark.parametrize("value, fragments", [("gemmma", ("did you mean gemma?",)),
                                              ("my/template.jinja", ("chat template file not found",))])
def test_generate_bad_chat_template(tmp_path, value, fragments):
    # fails before loading anything: the model path does not even exist
    assert_user_error(_gen(tmp_path / "no-model", "--chat-template", value), *fragments)


def test_serve_bad_chat_template_fails_at_once(tmp_path):
    r = run_cli("serve", "--model", str(tmp_path / "no-model"), "--chat-template", "lama3")
    assert_user_error(r, "did you mean llama3?")


# ---- the server, through the openai client ----------------------------------------------------


def test_server_chat_with_a_template_flag(plain_dir, template_file, tmp_path):
    openai = pytest.importorskip("openai")
    from test_server import ServerProcess

    m = selfspec.load(str(plain_dir), dtype="float32", device="cpu", chat_template=str(template_file))
    common = ["--model", str(plain_dir), "--dtype", "float32", "--device", "cpu", "--threads", "1", "--strategy", "early-exit",
              "--exit-layer", "2", "--served-model-name", "tiny"]
    s = ServerProcess([*common, "--chat-template", str(template_file)], tmp_path / "with.log")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}, {"role": "user", "content": "and"}]
        ref = m.generate(msgs, chat=True, max_new_tokens=12, temperature=0, strategy="autoregressive")
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == ref.prompt_tokens
        assert "chat template: the chat template" in s.log()
    finally:
        s.stop()
    s = ServerProcess(common, tmp_path / "without.log")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert "--chat-template" in str(e.value)
        assert client.completions.create(model="tiny", prompt="the cat", max_tokens=4).choices[0].text is not None
    finally:
        s.stop()


# ---- the default model (a base model, no template in its GGUF) ---------------------------------


@pytest.mark.slow
def test_default_model_chats_with_gemmas_turns(default_model):
    m = default_model
    assert "gemma" in m.chat_template_source
    end_of_turn = m.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in m.eos_token_ids
    ids = m.encode("What is the capital of France?", chat=True)
    assert m.tokenizer.decode(ids) == ("<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                                       "<start_of_turn>model\n")
    ar = m.generate("Name three colors.", chat=True, max_new_tokens=24, strategy="autoregressive")
    pl = m.generate("Name three colors.", chat=True, max_new_tokens=24, strategy="prompt-lookup")
    assert pl.token_ids == ar.token_ids and ar.text.strip()
    assert ar.finish_reason == "length" or ar.token_ids[-1] in m.eos_token_ids


@pytest.mark.slow
def test_default_model_generate_chat_cli(default_model):
    r = run_cli("generate", "Name three colors.", "--chat", "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "12",
                "--strategy", "autoregressive", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == default_model.generate("Name three colors.", chat=True, max_new_tokens=12,
                                                      strategy="autoregressive").token_ids
    notes = [line for line in r.stderr.splitlines() if "base model" in line]
    assert len(notes) == 1 and notes[0].startswith("selfspec: note: gemma-3-270m is a base model")


@pytest.mark.slow
def test_default_model_server_chat_with_openai(default_model, tmp_path):
    openai = pytest.importorskip("openai")
    from test_server import ServerProcess

    s = ServerProcess(["--dtype", "float32", "--device", "cpu", "--strategy", "autoregressive", "--threads", "1",
                       "--served-model-name", "gemma"], tmp_path / "gemma.log", startup_timeout=600)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        msgs = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What color is the sky?"}]
        ref = default_model.generate(msgs, chat=True, max_new_tokens=10, strategy="autoregressive")
        r = client.chat.completions.create(model="gemma", messages=msgs, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == ref.text and r.usage.prompt_tokens == ref.prompt_tokens
        chunks = list(client.chat.completions.create(model="gemma", messages=msgs, max_tokens=10, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
        assert "built-in gemma template" in s.log()
    finally:
        s.stop()
