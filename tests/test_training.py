"""selfspec.training: schedules and curricula, data, the decoder loop, layer dropout, loss
normalisation, resume, data parallelism, both recipes end to end (then lossless
generation), and the CLI's errors. Tiny models and a few hundred KB of text throughout."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import selfspec
import selfspec.training.data
from selfspec.cli import main
from selfspec.errors import SelfSpecError
from selfspec.training import schedules
from selfspec.training.config import AdapterConfig, DataConfig, LayerSkipConfig, LoopConfig, ModelConfig, TrainConfig
from selfspec.training.data import Document, build_corpus, read_documents, sequence_order, tokenize
from selfspec.training.decoder import Decoder
from selfspec.training.distributed import Dist
from selfspec.training.trainer import train

from helpers import ARCHS, VOCAB, WORDS, ar_generate, build_hf, word_tokenizer

ROOT = Path(__file__).resolve().parent.parent
STDLIB_FILES = ["textwrap.py", "shlex.py", "string.py", "bisect.py", "colorsys.py", "keyword.py", "json/decoder.py",
                "json/encoder.py", "json/scanner.py", "json/tool.py", "json/__init__.py"]


# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """~120 KB of real Python source in a directory (a few standard-library modules)."""
    import sysconfig

    src = Path(sysconfig.get_paths()["stdlib"])
    d = tmp_path_factory.mktemp("text")
    for name in STDLIB_FILES:
        (d / name.replace("/", "_")).write_text((src / name).read_text())
    return d


def _cfg(out: Path, text_dir: Path, recipe: str = "layerskip", **loop_kw) -> TrainConfig:
    loop = dict(max_steps=4, batch_size=4, grad_accum=2, eval_every=2, checkpoint_every=2, no_progress=True, threads=1)
    loop.update(loop_kw)
    return TrainConfig(
        recipe=recipe,
        out=str(out),
        data=DataConfig(data=(str(text_dir),), seq_len=32, eval_sequences=4),
        model=ModelConfig(preset="llama-tiny", train_tokenizer=300),
        layerskip=LayerSkipConfig(layer_dropout_max=0.5, layer_dropout_curriculum="none", early_exit_curriculum="rotational",
                                  early_exit_rotation=2, exit_loss_vocab=200),
        loop=LoopConfig(**loop),
    )


def _quiet(msg: str) -> None:
    pass


def _words_corpus(seq_len: int = 16, n_docs: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    docs = [Document(f"doc{i}", " ".join(WORDS[j] for j in torch.randint(0, 60, (50,), generator=g).tolist())) for i in range(n_docs)]
    tok = word_tokenizer(VOCAB, eos=True)
    return build_corpus(docs, tok, DataConfig(data=("x",), seq_len=seq_len, eval_fraction=0.2)), tok


def _task(recipe: str = "layerskip", arch: str = "llama", **ls_kw):
    from selfspec.training.layerskip import LayerSkipTask

    corpus, tok = _words_corpus()
    model = build_hf(arch, seed=1, num_layers=4)
    ls = dict(layer_dropout_curriculum="none")
    ls.update(ls_kw)
    cfg = TrainConfig(recipe=recipe, out="unused", model=ModelConfig(model="x"), layerskip=LayerSkipConfig(**ls),
                      loop=LoopConfig(max_steps=100, lr=1e-3, warmup_steps=0))
    return LayerSkipTask(cfg, model, tok, corpus, Dist()), model, corpus


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ---- schedules ----------------------------------------------------------------------------


def test_layer_dropout_rates_follow_the_layerskip_formula():
    L, p = 5, 0.2
    exp = schedules.layer_dropout_rates(10, 10, L, p, "exp", "none")
    assert exp[0] == 0.0 and exp[-1] == pytest.approx(p)
    assert exp == pytest.approx([p * (math.exp(l * math.log(2) / 4) - 1) for l in range(L)])
    assert schedules.layer_dropout_rates(3, 10, L, p, "linear", "none") == pytest.approx([0, 0.05, 0.1, 0.15, 0.2])
    assert schedules.layer_dropout_rates(3, 10, L, p, "uniform", "none") == pytest.approx([p] * L)
    # the from-scratch time curriculum: S(0) = 0, S(T/2) = sqrt(2) - 1, S(T) = 1
    assert schedules.layer_dropout_rates(0, 10, L, p, "uniform", "exp") == [0.0] * L
    assert schedules.layer_dropout_rates(5, 10, L, p, "uniform", "exp") == pytest.approx([p * (math.sqrt(2) - 1)] * L)
    assert schedules.layer_dropout_rates(10, 10, L, p, "exp", "exp") == pytest.approx(exp)


def test_learning_rate_warms_up_then_follows_a_cosine():
    lr = [schedules.lr_at(s, 1.0, 4, 14, 0.1) for s in range(16)]
    assert lr[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr[4] == pytest.approx(1.0) and lr[9] == pytest.approx(0.55) and lr[14] == pytest.approx(0.1)
    assert lr[15] == pytest.approx(0.1)  # past the horizon: stays at the floor
    assert all(a >= b for a, b in zip(lr[4:], lr[5:]))


def test_exit_curricula_choose_the_expected_layers():
    L = 8
    assert schedules.active_exits(5, 100, L, "none") == list(range(L))
    # rotational, R = 3: layers with (l - t) % 3 == 0, plus the last
    assert schedules.active_exits(0, 100, L, "rotational", rotation=3) == [0, 3, 6, 7]
    assert schedules.active_exits(1, 100, L, "rotational", rotation=3) == [1, 4, 7]
    assert schedules.active_exits(2, 100, L, "rotational", rotation=3) == [2, 5, 7]
    assert schedules.active_exits(3, 100, L, "rotational", rotation=3) == [0, 3, 6, 7]
    # gradual over the first half of 140 steps: layer l from step 70 * (7 - l) / 7 = 10 * (7 - l)
    g = lambda t: schedules.active_exits(t, 140, L, "gradual", gradual_fraction=0.5)  # noqa: E731
    assert g(0) == [7]
    assert g(9) == [7] and g(10) == [6, 7]
    assert g(35) == [4, 5, 6, 7] and g(40) == [3, 4, 5, 6, 7]
    assert g(69) == list(range(1, 8)) and g(70) == list(range(8)) and g(140) == list(range(8))


def test_exit_loss_scales_are_torchtunes_and_sum_to_one():
    layers, L = [0, 2, 3], 4
    raw = {
        "uniform": [1, 1, 1],
        "linear": [1, 3, 4],
        "sum": [1, 4, 8],  # running sums of (l + 1) over the active exits
        "sqrt": [1, math.sqrt(3), 2],
        "inverse": [1, 1 / 3, 1 / 4],
    }
    for kind, r in raw.items():
        got = schedules.exit_loss_scales(layers, L, kind, 1.0)
        assert got == pytest.approx([x / sum(r) for x in r]), kind
        # e_scale multiplies the non-final exits before normalisation
        half = [r[0] * 0.5, r[1] * 0.5, r[2]]
        assert schedules.exit_loss_scales(layers, L, kind, 0.5) == pytest.approx([x / sum(half) for x in half]), kind
    assert schedules.exit_loss_scales(layers, L, "sum", 0.0) == [0.0, 0.0, 1.0]


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("build, fragment", [
    (lambda: DataConfig(seq_len=1), "--seq-len"),
    (lambda: LayerSkipConfig(layer_dropout_max=1.5), "--layer-dropout-max"),
    (lambda: LayerSkipConfig(early_exit_curriculum="sideways"), "--early-exit-curriculum"),
    (lambda: LoopConfig(batch_size=0), "--batch-size"),
    (lambda: ModelConfig(preset="llama-tiny", model="x"), "choose one of"),
    (lambda: TrainConfig(recipe="layerskip"), "choose what to train"),
    (lambda: TrainConfig(recipe="exit-adapter", model=ModelConfig(model="x")), "--exit-layer"),
    (lambda: AdapterConfig(adapter_heads=-1), "--adapter-heads"),
    (lambda: AdapterConfig(adapter_head_dim=7), "--adapter-head-dim"),
])
def test_config_checks_itself(build, fragment):
    with pytest.raises(SelfSpecError, match=fragment):
        build()


def test_resolved_defaults_depend_on_the_recipe():
    scratch = TrainConfig(model=ModelConfig(preset="llama-tiny")).resolved()
    assert scratch.model.train_tokenizer == 8192 and scratch.loop.lr == 1e-3 and scratch.dropout_curriculum == "exp"
    cont = TrainConfig(model=ModelConfig(model="some/dir")).resolved()
    assert cont.loop.lr == 2e-5 and cont.dropout_curriculum == "none"
    ad = TrainConfig(recipe="exit-adapter", adapter=AdapterConfig(exit_layer=3)).resolved()
    assert ad.model.model == "gemma-3-270m" and ad.loop.lr == 3e-3


# ---- data ---------------------------------------------------------------------------------


def test_packing_shifts_targets_and_masks_prompts(tmp_path):
    tok = word_tokenizer(VOCAB, eos=True)
    f = tmp_path / "pairs.jsonl"
    f.write_text(json.dumps({"prompt": "the cat", "response": " sat on the mat"}) + "\n\n" + json.dumps({"text": "a dog ran"}) + "\n")
    docs = read_documents(DataConfig(data=(str(f),)))
    s = tokenize(docs, tok)
    words = tok.convert_ids_to_tokens(s.ids.tolist())
    assert words == ["the", "cat", "sat", "on", "the", "mat", "<eos>", "a", "dog", "ran", "<eos>"]
    assert s.target.tolist() == [False, False, True, True, True, True, True, True, True, True, True]
    corpus = build_corpus(docs, tok, DataConfig(data=("x",), seq_len=4, eval_fraction=0.0))
    x, y, w = corpus.train.sequences([0, 1])
    assert x[0].tolist() == s.ids[0:4].tolist() and y[0].tolist() == s.ids[1:5].tolist()
    assert x[1].tolist() == s.ids[4:8].tolist() and y[1].tolist() == s.ids[5:9].tolist()
    assert w[0].tolist() == [False, True, True, True]


def test_held_out_split_is_deterministic_and_by_document(text_dir):
    docs = read_documents(DataConfig(data=(str(text_dir), "stdlib")))
    ids = [d.id for d in docs]
    assert len(ids) == len(set(ids)) and any(i.startswith("stdlib:") for i in ids) and any(i.startswith("pydoc:") for i in ids)
    from selfspec.training.data import is_held_out

    held = [i for i in ids if is_held_out(i, 0.02)]
    assert 0 < len(held) < len(ids) * 0.06
    # a pure function of the id, the same in every process (a salted hash() would not be):
    # pinned values, and a larger fraction only adds documents
    assert [i for i in range(40) if is_held_out(f"doc{i}", 0.25)] == [8, 11, 14, 16, 17, 20, 22, 25, 26, 37, 38]
    assert set(held) <= {i for i in ids if is_held_out(i, 0.1)}


def test_data_order_resumes_anywhere():
    full = sequence_order(10, 3, 0, 35)  # three and a half epochs
    assert sorted(full[:10]) == list(range(10)) and sorted(full[10:20]) == list(range(10)) and full[:10] != full[10:20]
    assert sequence_order(10, 3, 17, 9) == full[17:26]


# ---- the decoder loop and layer dropout -------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_loop_is_the_models_own_forward(arch):
    hf = build_hf(arch, seed=2)  # eager attention: our loop must give the very same bits
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(0))
    dec = Decoder(hf)
    with torch.no_grad():
        ours = dec.logits(dec.hidden_states(ids)[dec.num_layers - 1])
        theirs = hf(ids, use_cache=False).logits.float()
    assert torch.equal(ours, theirs)


def test_a_dropped_layer_is_skipped_for_that_sample_only():
    hf = build_hf("llama", seed=3)
    dec = Decoder(hf)
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[0, 2] = False
    with torch.no_grad():
        full = dec.hidden_states(ids)
        drop = dec.hidden_states(ids, keep)
    assert torch.equal(drop[2][0], drop[1][0])  # residual passes through layer 2 for sample 0
    assert torch.allclose(drop[2][1:], full[2][1:], atol=1e-6)  # the others ran it
    assert not torch.allclose(drop[3][0], full[3][0])


def test_layer_dropout_frequency_matches_the_rates_and_eval_mode_drops_nothing():
    task, model, corpus = _task(layer_dropout_max=0.6, layer_dropout_schedule="linear")
    rates = task.dropout_rates(7)
    assert rates == pytest.approx([0.0, 0.2, 0.4, 0.6])
    n = 256 * 40
    dropped = torch.zeros(4)
    for micro in range(40):
        dropped += (~task.keep_mask(7, micro, 256, 0, 256)).float().sum(0)
    for l, p in enumerate(rates):
        sd = math.sqrt(p * (1 - p) / n) if 0 < p < 1 else 0.0
        assert abs(dropped[l].item() / n - p) <= 4 * sd + 1e-12, (l, dropped[l].item() / n, p)
    # rows of one global draw: a rank's slice is exactly its part of the single-process mask
    whole = task.keep_mask(7, 3, 8, 0, 8)
    assert torch.equal(torch.cat([task.keep_mask(7, 3, 8, 0, 4), task.keep_mask(7, 3, 8, 4, 8)]), whole)
    # eval mode: no dropout at all, so the loss is deterministic and equals the no-dropout loss
    idx = list(range(4))
    task.begin_step(7, idx)
    model.eval()
    a = task.micro_loss(7, 0, idx, 0, 4)[0]
    b = task.micro_loss(7, 1, idx, 0, 4)[0]
    task.p_max = 0.0
    model.train()
    c = task.micro_loss(7, 0, idx, 0, 4)[0]
    assert a.item() == b.item() == pytest.approx(c.item(), abs=1e-6)


# ---- losses -------------------------------------------------------------------------------


def test_plain_loss_is_the_mean_next_token_cross_entropy_whatever_the_micro_batches():
    task, model, corpus = _task(recipe="lm")
    model.eval()
    idx = [0, 3, 5, 6]
    task.begin_step(0, idx)
    whole = task.micro_loss(0, 0, idx, 0, 4)[0]
    parts = task.micro_loss(0, 0, idx[:1], 0, 4)[0] + task.micro_loss(0, 0, idx[1:], 1, 4)[0]
    x, y, _ = corpus.train.sequences(idx)
    with torch.no_grad():
        ref = F.cross_entropy(model(x, use_cache=False).logits.reshape(-1, VOCAB).float(), y.reshape(-1))
    assert whole.item() == pytest.approx(ref.item(), rel=1e-5) and parts.item() == pytest.approx(ref.item(), rel=1e-5)


def test_early_exit_loss_is_the_weighted_sum_of_per_layer_losses():
    task, model, corpus = _task(early_exit_curriculum="none", early_exit_scale_type="linear", early_exit_scale=0.5, layer_dropout_max=0.0)
    model.eval()
    idx = [1, 2]
    task.begin_step(0, idx)
    loss = task.micro_loss(0, 0, idx, 0, 2)[0]
    x, y, _ = corpus.train.sequences(idx)
    dec = Decoder(model)
    with torch.no_grad():
        hs = dec.hidden_states(x)
        per_layer = [F.cross_entropy(dec.logits(hs[l]).reshape(-1, VOCAB), y.reshape(-1)).item() for l in range(4)]
    w = [0.5 * 1, 0.5 * 2, 0.5 * 3, 4]
    assert loss.item() == pytest.approx(sum(wi * li for wi, li in zip(w, per_layer)) / sum(w), rel=1e-5)


def test_exit_loss_vocabulary_restricts_the_non_final_exits():
    task, model, corpus = _task(early_exit_curriculum="none", early_exit_scale_type="uniform", layer_dropout_max=0.0, exit_loss_vocab=20)
    counts = corpus.train.target_counts(VOCAB)
    top = set(torch.sort(-counts.double(), stable=True).indices[:20].tolist())
    assert set(task.exit_vocab.tolist()) == top and task.exit_vocab.tolist() == sorted(top)
    model.eval()
    idx = [0, 1]
    task.begin_step(0, idx)
    loss = task.micro_loss(0, 0, idx, 0, 2)[0]
    x, y, _ = corpus.train.sequences(idx)
    dec = Decoder(model)
    vocab = task.exit_vocab
    slot = {t: i for i, t in enumerate(vocab.tolist())}
    inside = torch.tensor([t in slot for t in y.reshape(-1).tolist()])
    remapped = torch.tensor([slot.get(t, 0) for t in y.reshape(-1).tolist()])
    with torch.no_grad():
        hs = dec.hidden_states(x)
        exits = [F.cross_entropy(dec.logits(hs[l], vocab).reshape(-1, 20)[inside], remapped[inside]).item() for l in range(3)]
        final = F.cross_entropy(dec.logits(hs[3]).reshape(-1, VOCAB), y.reshape(-1)).item()
    assert loss.item() == pytest.approx((sum(exits) + final) / 4, rel=1e-5)


def _gamma(n: int) -> float:
    """Higham's gamma_n: n float32 roundings, the worst case of an n-term sum or dot product
    relative to the sum of its terms' magnitudes."""
    u = torch.finfo(torch.float32).eps / 2
    return n * u / (1 - n * u)


def test_chunked_exit_loss_equals_the_plain_one(monkeypatch):
    """Chunking computes the same terms and adds them in another order, and runs the head's
    matmuls over 5 rows instead of 48 (which may pick other kernels): equal up to the rounding
    of re-associated sums, bounded by gamma_n times the magnitudes of the terms, not bit for
    bit."""
    from selfspec.training import layerskip

    task, model, corpus = _task()
    x, y, w = corpus.train.sequences([0, 1, 2])
    dec = Decoder(model)
    down = model.model.layers[0].mlp.down_proj
    seen: dict = {}
    down.register_forward_hook(lambda mod, inp, out: seen.__setitem__("x", inp[0].detach()))
    down.register_full_backward_hook(lambda mod, g_in, g_out: seen.__setitem__("dy", g_out[0].detach()))

    def value_and_grad(recompute: bool):
        model.zero_grad()
        hs = dec.hidden_states(x, collect={1})
        v = layerskip.exit_ce_sum(dec, hs[1], y, w.float(), None, recompute)
        v.backward()
        return v.item(), down.weight.grad.clone(), hs[1].detach()

    plain, g_plain, h = value_and_grad(False)
    monkeypatch.setattr(layerskip, "LOGITS_PER_CHUNK", VOCAB * 5)  # 5 rows per chunk: 10 chunks
    chunked, g_chunked, _ = value_and_grad(False)
    N, H = h.shape[0] * h.shape[1], h.shape[-1]
    with torch.no_grad():
        # value: each term w * CE (>= 0) moves by at most 2 * max |logit error| (the CE's
        # gradient in the logits has L1 norm <= 2); a logit (final norm, then an H-term dot
        # product) by 2 gamma_H times |W| |normed h|; the sum of the N terms by gamma_N * total.
        scale = (model.model.norm(h.reshape(N, H)).abs() @ model.lm_head.weight.abs().T).max(-1).values
        value_tol = 2 * _gamma(N) * plain + (w.reshape(N).float() * 2 * 2 * _gamma(H) * scale).sum().item()
        # gradient: sum over the N rows of x_r (x) dy_r, each dy_r behind a V-term head backward
        # and H-term layer products: (N + V + H) roundings of the magnitude sum |dy|^T |x|.
        magnitude = seen["dy"].reshape(N, -1).abs().T @ seen["x"].reshape(N, -1).abs()
        grad_tol = 2 * _gamma(N + VOCAB + H) * magnitude
    assert abs(chunked - plain) <= value_tol, (chunked, plain, value_tol)
    assert ((g_chunked - g_plain).abs() <= grad_tol).all(), ((g_chunked - g_plain).abs().max(), grad_tol.max())
    # the bounds are far below what a lost or doubled chunk (5 of 48 rows) would change
    assert value_tol < 0.01 * plain and (grad_tol < 0.01 * g_plain.abs().max()).all()


# ---- whole runs ---------------------------------------------------------------------------


def test_resume_continues_exactly(tmp_path, text_dir):
    straight = train(_cfg(tmp_path / "straight", text_dir), log=_quiet)

    class Killed(Exception):
        pass

    def kill_at_3(step, rec):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        train(_cfg(tmp_path / "killed", text_dir), log=_quiet, on_step=kill_at_3)
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert ckpts == ["step-000002"]  # the step after the last checkpoint is lost, nothing else
    resumed = train(replace(_cfg(tmp_path / "killed", text_dir), resume=True), log=_quiet)
    assert resumed.loop.step == 4
    a, b = _weights(straight.final), _weights(resumed.final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la = [r["loss"] for r in straight.loop.records if "loss" in r]
    lb = [r["loss"] for r in resumed.loop.records if "loss" in r]
    assert la == lb and len(la) == 4


def test_layerskip_run_then_early_exit_is_lossless(tmp_path, text_dir):
    result = train(_cfg(tmp_path / "run", text_dir, max_steps=2), log=_quiet)
    files = {p.name for p in result.final.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "training.json"} <= files
    assert (tmp_path / "run" / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ev = json.loads((result.final / "training.json").read_text())["eval"]
    assert len(ev["exit_agreement"]) == 4 and all(0 <= a <= 1 for a in ev["exit_agreement"]) and ev["exit_agreement"][-1] == 1.0
    m = selfspec.load(str(result.final), dtype="float32")
    prompt = "def wrap(text, width=70):"
    ar = ar_generate(m, prompt, max_new_tokens=24)
    for E in (1, 2, 3):
        out = m.generate(prompt, max_new_tokens=24, strategy="early-exit", exit_layer=E, num_speculations=3)
        assert out.token_ids == ar.token_ids, E


def test_two_processes_give_the_single_process_loss_curve(tmp_path, text_dir):
    args = ["--preset", "llama-tiny", "--data", str(text_dir), "--train-tokenizer", "300", "--seq-len", "32", "--batch-size", "4",
            "--grad-accum", "2", "--max-steps", "3", "--eval-every", "3", "--checkpoint-every", "3", "--threads", "1", "--no-progress",
            "--eval-sequences", "4", "--layer-dropout-max", "0.5", "--layer-dropout-curriculum", "none", "--early-exit-curriculum", "rotational"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    single = subprocess.run([sys.executable, "-m", "selfspec", "train", *args, "--out", str(tmp_path / "one")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          "-m", "selfspec", "train", *args, "--out", str(tmp_path / "two")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert ddp.returncode == 0, ddp.stderr[-2000:]

    def curve(d):
        recs = [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in recs if "loss" in r], [x for r in recs if "eval" in r for x in r["eval"]["exit_loss"]]

    (l1, e1), (l2, e2) = curve("one"), curve("two")
    assert len(l1) == len(l2) == 3
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-6)
    assert len(e1) == len(e2) == 8 and e1 == pytest.approx(e2, rel=1e-5)  # held-out per-layer losses at steps 0 and 3


def test_ctrl_c_stops_between_steps_with_a_checkpoint(tmp_path, text_dir):
    import signal

    def press_ctrl_c(step, rec):
        if step == 1:
            signal.raise_signal(signal.SIGINT)

    r = train(_cfg(tmp_path / "run", text_dir, max_steps=6, checkpoint_every=5), log=_quiet, on_step=press_ctrl_c)
    assert r.loop.stopped_by == "interrupt" and r.loop.step == 1
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-000001"]


def test_continued_training_of_a_gemma3_model(tmp_path, text_dir):
    """--model: a sliding-window, qk-norm, sandwich-norm architecture through the same loop."""
    src = tmp_path / "gemma"
    hf = build_hf("gemma3", seed=4, num_layers=4, vocab_size=300)
    hf.save_pretrained(src)
    tok = selfspec.training.data.train_bpe_tokenizer(read_documents(DataConfig(data=(str(text_dir),))), 300)
    tok.save_pretrained(src)
    cfg = replace(_cfg(tmp_path / "run", text_dir, max_steps=2), model=ModelConfig(model=str(src)))
    result = train(cfg, log=_quiet)
    before, after = _weights(src), _weights(result.final)
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
    m = selfspec.load(str(result.final), dtype="float32")
    ar = ar_generate(m, "def f(x):", max_new_tokens=16)
    assert m.generate("def f(x):", max_new_tokens=16, strategy="early-exit", exit_layer=2, num_speculations=4).token_ids == ar.token_ids


def test_from_a_config_file_and_a_tokenizer_directory_then_resume_with_a_longer_budget(tmp_path, text_dir, capsys):
    from transformers import LlamaConfig

    tok_dir = tmp_path / "tok"
    tok = selfspec.training.data.train_bpe_tokenizer(read_documents(DataConfig(data=(str(text_dir),))), 320)
    tok.save_pretrained(tok_dir)
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                    max_position_embeddings=128, tie_word_embeddings=False).to_json_string())
    out = tmp_path / "run"
    common = ["--data", str(text_dir), "--seq-len", "32", "--batch-size", "2", "--threads", "1", "--no-progress", "--eval-sequences", "2"]
    assert main(["train", "--config", str(cfg_file), "--tokenizer", str(tok_dir), "--max-steps", "2", "--out", str(out), *common]) == 0
    capsys.readouterr()
    # the run's own settings come back from the checkpoint; only the budget changes
    assert main(["train", "--out", str(out), "--resume", "--max-steps", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out / "final")
    summary = json.loads((out / "final" / "training.json").read_text())
    assert summary["steps"] == 3 and summary["config"]["model"]["config"] == str(cfg_file)
    assert json.loads((out / "final" / "config.json").read_text())["num_hidden_layers"] == 3
    _user_error(capsys, ["--out", str(out), "--resume", "--seq-len", "16"], "--seq-len was 32")
    small = tmp_path / "small.json"
    small.write_text(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2).to_json_string())
    _user_error(capsys, ["--config", str(small), "--tokenizer", str(tok_dir), "--out", str(tmp_path / "x"), *common], "vocab_size 100")
    _user_error(capsys, ["--preset", "llama-huge", "--out", str(tmp_path / "y"), *common], "unknown preset")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    build_hf("llama", seed=0, num_layers=4).save_pretrained(d)
    word_tokenizer(VOCAB, eos=True).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def words_file(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(5)
    lines = [" ".join(WORDS[j] for j in torch.randint(0, 40, (30,), generator=g).tolist()) for _ in range(200)]
    f = tmp_path_factory.mktemp("words") / "words.txt"
    f.write_text("\n".join(lines) + "\n")
    return f


def _adapter_cfg(out: Path, model_dir: Path, data: Path, loop: dict | None = None, **adapter_kw) -> TrainConfig:
    ad = dict(exit_layer=2, adapter_size=32, draft_vocab=0, teacher_tokens=2000, num_speculations=3)
    ad.update(adapter_kw)
    lp = dict(max_steps=6, batch_size=4, eval_every=6, checkpoint_every=6, no_progress=True, lr=3e-3)
    lp.update(loop or {})
    return TrainConfig(recipe="exit-adapter", out=str(out), data=DataConfig(data=(str(data),), seq_len=32, eval_sequences=4),
                       model=ModelConfig(model=str(model_dir)), adapter=AdapterConfig(**ad), loop=LoopConfig(**lp))


@pytest.mark.parametrize("heads", [0, 2])
def test_untrained_adapter_is_plain_early_exit_and_distillation_learns(tiny_model_dir, words_file, heads):
    from selfspec.training.adapter_train import AdapterTask

    m = selfspec.load(str(tiny_model_dir), dtype="float32")
    m.set_token_frequencies(torch.arange(VOCAB))  # draft vocabulary: ids 0..39 (the text uses ids 1..41)
    cfg = _adapter_cfg("unused", tiny_model_dir, words_file, draft_vocab=40, adapter_heads=heads, adapter_head_dim=8).resolved()
    corpus = build_corpus(read_documents(cfg.data), m.tokenizer, cfg.data)
    task = AdapterTask(cfg, m, corpus, Dist())
    assert task.vocab.tolist() == list(range(40))
    assert len(task.params) == (6 if heads else 3)
    before = task.evaluate(4)
    assert before["adapter_agreement"] == before["early_exit_agreement"]  # down = out = 0: the same draft
    opt = torch.optim.AdamW(task.params, lr=1e-2)
    for step in range(30):
        idx = sequence_order(task.num_sequences(), 0, step * 4, 4)
        task.begin_step(step, idx)
        loss, _ = task.micro_loss(step, 0, idx, 0, 4)
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = task.evaluate(4)
    # held-out KL to the full model drops clearly (agreement on a random tiny model is too noisy to assert)
    assert after["distill_loss"] < 0.9 * before["distill_loss"]
    assert after["early_exit_agreement"] == before["early_exit_agreement"]  # the model itself is untouched


@pytest.mark.parametrize("heads", [0, 2])
def test_exit_adapter_resume_continues_exactly(tmp_path, tiny_model_dir, words_file, heads):
    from safetensors.torch import load_file

    def cfg(out: Path) -> TrainConfig:
        return _adapter_cfg(out, tiny_model_dir, words_file, loop=dict(max_steps=4, checkpoint_every=2, eval_every=4),
                            adapter_heads=heads, adapter_head_dim=8)

    straight = train(cfg(tmp_path / "a"), log=_quiet)

    def kill_at_3(step, rec):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(cfg(tmp_path / "b"), log=_quiet, on_step=kill_at_3)
    resumed = train(replace(cfg(tmp_path / "b"), resume=True), log=_quiet)
    a, b = load_file(str(straight.final / "adapter.safetensors")), load_file(str(resumed.final / "adapter.safetensors"))
    assert sorted(a) == sorted(b) == sorted(["norm", "up", "down"] + (["attn_norm", "qkv", "out"] if heads else []))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("heads", [0, 2])
def test_exit_adapter_run_writes_a_profile_that_generates_losslessly(tmp_path, tiny_model_dir, words_file, heads):
    from selfspec.adapter import load_adapter

    result = train(_adapter_cfg(tmp_path / "ad", tiny_model_dir, words_file, adapter_heads=heads, adapter_head_dim=8), log=_quiet)
    adapter = load_adapter(result.final / "adapter.safetensors")
    assert adapter.meta.exit_layer == 2 and adapter.down.abs().sum() > 0  # trained: no longer plain early exit
    assert adapter.meta.heads == heads and (not heads or adapter.out.abs().sum() > 0)
    m = selfspec.load(str(tiny_model_dir), dtype="float32")
    profile = selfspec.load_profile(result.final / "profile.json", m.fingerprint)
    assert profile.draft.strategy == "exit-adapter" and Path(profile.draft.adapter) == (result.final / "adapter.safetensors").resolve()
    prompt = "the cat sat on the mat and"
    ar = ar_generate(m, prompt, max_new_tokens=20)
    out = m.generate(prompt, max_new_tokens=20, profile=str(result.final / "profile.json"))
    assert out.token_ids == ar.token_ids and out.stats.drafted > 0


# ---- the command line ---------------------------------------------------------------------


def _user_error(capsys, argv: list[str], *fragments: str) -> str:
    code = main(["train", *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("selfspec: error:"), err
    for f in fragments:
        assert f.lower() in err[0].lower(), err[0]
    return err[0]


def test_cli_rejects_a_data_path_without_text(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "picture.png").write_bytes(b"\x89PNG")
    _user_error(capsys, ["--preset", "llama-tiny", "--data", str(empty), "--out", str(tmp_path / "o")], "no text found")
    _user_error(capsys, ["--preset", "llama-tiny", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "o")], "not found")


@pytest.mark.skipif(__import__("importlib").util.find_spec("datasets") is not None, reason="datasets is installed")
def test_cli_explains_that_hf_data_needs_datasets(tmp_path, capsys):
    _user_error(capsys, ["--preset", "llama-tiny", "--data", "hf:wikitext:train", "--out", str(tmp_path / "o")], "datasets")


def test_cli_rejects_a_sequence_longer_than_the_context(tmp_path, capsys, text_dir, tiny_model_dir):
    _user_error(capsys, ["--preset", "llama-tiny", "--data", str(text_dir), "--seq-len", "4096", "--out", str(tmp_path / "a")],
                "--seq-len 4096", "context (2048")
    _user_error(capsys, ["--model", str(tiny_model_dir), "--data", str(text_dir), "--seq-len", "1024", "--out", str(tmp_path / "b")],
                "context (512")


def test_cli_rejects_an_exit_layer_outside_the_model(tmp_path, capsys, tiny_model_dir, words_file):
    _user_error(capsys, ["--recipe", "exit-adapter", "--model", str(tiny_model_dir), "--exit-layer", "4", "--data", str(words_file),
                         "--out", str(tmp_path / "o")], "--exit-layer must be in 1..3")
    _user_error(capsys, ["--recipe", "exit-adapter", "--model", str(tiny_model_dir), "--data", str(words_file),
                         "--out", str(tmp_path / "o")], "needs --exit-layer")


def test_cli_rejects_an_unwritable_output_and_never_overwrites_a_run(tmp_path, capsys, text_dir):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    _user_error(capsys, ["--preset", "llama-tiny", "--data", str(text_dir), "--out", str(blocker / "run")], "cannot write to --out")
    _user_error(capsys, ["--preset", "llama-tiny", "--data", str(text_dir), "--out", str(blocker)], "not a directory")
    assert blocker.read_text() == "not a directory"
    run = tmp_path / "done"
    (run / "final").mkdir(parents=True)
    (run / "final" / "model.safetensors").write_bytes(b"precious")
    _user_error(capsys, ["--preset", "llama-tiny", "--data", str(text_dir), "--out", str(run)], "already holds a training run", "--resume")
    _user_error(capsys, ["--out", str(run), "--resume"], "nothing to resume")
    assert (run / "final" / "model.safetensors").read_bytes() == b"precious"
    assert sorted(p.name for p in run.iterdir()) == ["final"]


def test_distillation_targets_and_kl_are_the_formulas():
    from selfspec.training.adapter_train import distill_kl, teacher_targets

    g = torch.Generator().manual_seed(0)
    teacher, draft = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g)
    p, ids = teacher_targets(teacher, 2.0, 12)  # k = N: the whole distribution, nothing dropped
    torch.testing.assert_close(p.sum(-1), torch.ones(5))
    torch.testing.assert_close(p, (teacher / 2.0).softmax(-1).gather(1, ids))
    want = torch.nn.functional.kl_div((draft / 2.0).log_softmax(-1), (teacher / 2.0).softmax(-1), reduction="none").sum(-1)
    torch.testing.assert_close(distill_kl(draft, ids, p, 2.0), want)
    assert distill_kl(teacher, ids, p, 2.0).abs().max() < 1e-6  # the draft equal to the teacher: no loss
    p3, ids3 = teacher_targets(teacher, 1.0, 3)
    assert torch.equal(ids3, teacher.topk(3, dim=-1).indices) and torch.allclose(p3.sum(-1), torch.ones(5))


# ---- the first hour: resuming with a new budget, a caveat on degenerate agreement (issue 19) -------


def test_a_new_max_steps_replans_the_learning_rate_without_a_jump():
    peak, floor = 1e-3, 1e-4

    def lrs(start, stop, total, replan, warmup=2):
        return [schedules.lr_at(s, peak, warmup, total, 0.1, replan) for s in range(start, stop)]

    # the case: a finished 20-step run extended to 40 stays at the floor it reached
    replan, msg = schedules.replan_on_resume(20, peak, 2, 0.1, 20, 40, None)
    assert lrs(20, 41, 40, replan) == pytest.approx([floor] * 21) and "floor" in msg and "20 -> 40" in msg
    # stopped at step 10 of 40, shortened to 20: from the rate step 10 had, down to the floor at 20
    replan, msg = schedules.replan_on_resume(10, peak, 2, 0.1, 40, 20, None)
    new = lrs(10, 21, 20, replan)
    assert new[0] == schedules.lr_at(10, peak, 2, 40, 0.1) and new[-1] == pytest.approx(floor)
    assert all(a > b for a, b in zip(new, new[1:])) and "re-planned from" in msg and "step 20" in msg
    # extended mid-run, then changed again: continuous at each change, never rising
    r1, _ = schedules.replan_on_resume(10, peak, 2, 0.1, 20, 40, None)
    r2, _ = schedules.replan_on_resume(25, peak, 2, 0.1, 40, 30, r1)
    path = lrs(2, 10, 20, None) + lrs(10, 25, 40, r1) + lrs(25, 31, 30, r2)
    assert all(a >= b for a, b in zip(path, path[1:])) and path[-1] == pytest.approx(floor)
    # during the warm-up nothing is re-planned: the warm-up ends, the cosine reaches the new horizon
    assert schedules.replan_on_resume(1, peak, 4, 0.1, 10, 20, None)[0] is None
    assert "warm-up continues" in schedules.replan_on_resume(1, peak, 4, 0.1, 10, 20, None)[1]
    # the same budget: nothing changes, nothing to say
    assert schedules.replan_on_resume(10, peak, 2, 0.1, 40, 40, r1) == (r1, None)


def _lrs(out: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "lr" in r}


def test_resume_with_a_longer_budget_keeps_the_learning_rate_smooth(tmp_path, text_dir):
    out = tmp_path / "run"
    train(_cfg(out, text_dir, max_steps=4), log=_quiet)
    said: list[str] = []
    cfg = _cfg(out, text_dir, max_steps=4)
    train(replace(cfg, resume=True, loop=replace(cfg.loop, max_steps=8)), log=said.append)
    lr = _lrs(out)
    assert sorted(lr) == list(range(1, 9))
    assert all(lr[s] <= lr[4] * (1 + 1e-12) for s in range(5, 9))  # the issue: 1.06e-4 at step 20 -> 3.39e-4 at step 21
    assert any("--max-steps 4 -> 8" in m and "floor" in m for m in said), said


def test_resume_with_a_shorter_budget_anneals_from_the_current_rate(tmp_path, text_dir):
    import signal

    def press_ctrl_c(step, rec):
        if step == 2:
            signal.raise_signal(signal.SIGINT)

    out = tmp_path / "run"
    cfg = _cfg(out, text_dir, max_steps=8, checkpoint_every=10)
    assert train(cfg, log=_quiet, on_step=press_ctrl_c).loop.step == 2
    said: list[str] = []
    train(replace(cfg, resume=True, loop=replace(cfg.loop, max_steps=4)), log=said.append)
    lr, loop = _lrs(out), cfg.resolved().loop
    assert lr[3] == schedules.lr_at(2, loop.lr, loop.warmup_steps, 8, loop.min_lr_ratio)  # no jump
    assert lr[4] < lr[3]
    assert any("re-planned from" in m and "curricula keep their horizon (step 8)" in m for m in said), said


def test_agreement_with_a_degenerate_last_layer_carries_a_caveat(monkeypatch):
    from selfspec.training.layerskip import degenerate_caveat

    assert degenerate_caveat({"final_top_token_share": 0.2, "final_distinct_tokens": 40}) is None
    assert "one token at 97%" in degenerate_caveat({"final_top_token_share": 0.97, "final_distinct_tokens": 2})
    task, model, _ = _task()
    ev = task.evaluate(4)
    assert 0 < ev["final_top_token_share"] <= 1 and ev["final_distinct_tokens"] >= 1
    V = model.config.vocab_size

    def one_token(h, vocab=None):  # a 20-step model: the same prediction everywhere
        out = torch.zeros(*h.shape[:-1], V)
        out[..., 5] = 1.0
        return out

    monkeypatch.setattr(task.dec, "logits", one_token)
    ev = task.evaluate(4)
    assert ev["exit_agreement"] == pytest.approx([1.0] * task.L)
    assert ev["final_top_token_share"] == 1.0 and ev["final_distinct_tokens"] == 1
    assert "caveat" in ev and "caveat: the last layer predicts one token at 100%" in task.summary(ev)
