"""Issue "never slower": the speedup predictor, the auto strategy with fallback, exit
adapters at inference, and `selfspec search` (Optuna, shared storage, profiles).

The predictor's acceptance side is checked exactly: replaying greedy speculative decoding
over teacher-forced continuations must count the same steps, drafts and acceptances as
the engine really does (early exit, thresholds, prompt lookup). auto must stay lossless
whatever it decides, fall back to plain decoding when drafts are bad, and draft when
they are good."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import selfspec
from selfspec import kernels
from selfspec.adapter import AdapterCache, AdapterMeta, ExitAdapter, load_adapter, save_adapter
from selfspec.config import DraftConfig, SamplingConfig
from selfspec.drafters import AutoDrafter
from selfspec.engine import generate
from selfspec.lookup import lookup_continuation
from selfspec.errors import SelfSpecError
from selfspec.profiles import Profile, load_profile, save_profile
from selfspec.predictor.costs import CostModel
from selfspec.predictor.simulate import Agreement as Signal
from selfspec.predictor.simulate import expected_tokens, simulate

from helpers import ARCHS, VOCAB, ar_generate, build_hf, prompts, word_tokenizer
from test_cli import ROOT, assert_user_error, run_cli

N_NEW = 32


def _fake_costs(L=6, layer=1.0, head=2.0, draft_head=0.5) -> CostModel:
    rows = (1, 2, 3, 5, 9, 17)
    # the int8 copy's sub-layers at half the cost (calibration scores it where the kernels run)
    return CostModel(L, {r: layer / 2 for r in rows}, {r: layer / 2 for r in rows}, {r: head for r in rows}, {100: draft_head},
                     quant_layers={8: (layer / 4, layer / 4)})


# ---- the predictor -------------------------------------------------------------------------------


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_simulate_walk_by_hand():
    # match: positions 0,1 right, 2 wrong, 3..5 right. K=2: step at 0 accepts 2 (commits 3, next
    # pending 3); step at 3 accepts 2 (next 6); step at 6 has k=min(2, 7-6-1)=0.
    cal = Signal(np.array([1, 1, 0, 1, 1, 1, 0], bool), np.ones(7))
    costs = _fake_costs()
    pred = simulate(DraftConfig("early-exit", exit_layer=3, num_speculations=2), cal, costs)
    assert (pred.steps, pred.drafted, pred.accepted, pred.tokens) == (3, 4, 4, 7)
    # time: 2 full steps of 2 drafts (3 layers + draft head each; verify = 1 extra pass through
    # layers < E, then 3 layers over 3 rows + head) + 1 plain step (6 layers + head)
    draft = 3 * 1.0 + 2.0
    verify = 3 * 1.0 + 3 * 1.0 + 2.0
    assert pred.time_s == pytest.approx(2 * (2 * draft + verify) + (6 + 2.0))
    assert pred.ar_time_s == pytest.approx(7 * 8.0)


def test_simulate_threshold_stop_costs_one_more_draft():
    cal = Signal(np.array([1, 1, 1, 1], bool), np.array([0.9, 0.1, 0.9, 0.9]))
    costs = _fake_costs(L=4)
    cfg = DraftConfig("early-exit", exit_layer=2, num_speculations=3, draft_threshold=0.5)
    pred = simulate(cfg, cal, costs)
    # step at 0 (k=3): drafts position 0, stops at 1 (confidence 0.1): 1 drafted, accepted, and
    # position 1 was still run through the draft (its confidence was read); commits 2 tokens.
    # step at 2 (k = min(3, 4-2-1) = 1): drafts position 2, accepted; commits 2 tokens.
    assert (pred.steps, pred.drafted, pred.accepted, pred.tokens) == (2, 2, 2, 4)
    draft = 2 * 1.0 + 2.0  # layers < E + the full head
    verify_cached = 2 * 1.0 + 2.0  # the stopped position's exit state is cached: layers E.. over 2 rows + head
    verify_fresh = 2 * 1.0 + verify_cached  # the last draft's input still goes through layers < E
    assert pred.time_s == pytest.approx((2 * draft + verify_cached) + (draft + verify_fresh))
    # without the threshold one step drafts all 3 and commits the 4 tokens
    plain = simulate(cfg.replace(draft_threshold=None), cal, costs)
    assert (plain.steps, plain.drafted, plain.accepted, plain.tokens) == (1, 3, 3, 4)
    assert plain.time_s == pytest.approx(3 * draft + verify_fresh)


def test_guessed_passes_by_hand():
    """A quantized lookup-first draft checks copies (draft_guessed): one pass covers the draft
    tokens a copy foretells, and a pass ends at the first wrong guess or wrong draft."""
    from selfspec.predictor.simulate import _guessed_passes

    # the pending token is tokens[3]; the target continues 1 2 3 0 (a repeat of the prompt)
    tokens = [0, 1, 2, 3, 0, 1, 2, 3, 0]
    q = 4  # absolute index of the pending token (0): the lookup copies 1 2 3 0
    right = Signal(np.ones(4, bool), np.ones(4))
    assert _guessed_passes(right, tokens, q, 0, 4, 3, 4) == 1  # the copy foretells all 4 drafts
    wrong2 = Signal(np.array([1, 0, 1, 1], bool), np.ones(4))  # the draft's 2nd token is not the target's
    assert _guessed_passes(wrong2, tokens, q, 0, 4, 3, 4) == 3  # pass 1: drafts 1, 2 (wrong); then one a pass
    nomatch = [5, 6, 7, 8, 9, 1, 2, 3, 4]  # no earlier occurrence of any suffix: no guess
    assert _guessed_passes(right, nomatch, 4, 0, 4, 3, 4) == 4
    # the engine's prediction: the same drafts and acceptance as without the lookup, fewer passes
    costs = _fake_costs()
    cal = Signal(np.ones(5, bool), np.ones(5))
    seq = [0, 1, 2, 3, 0, 1, 2, 3, 0]
    plain = simulate(DraftConfig("quantized", num_speculations=4), cal, costs, tokens=seq, start=4)
    guessed = simulate(DraftConfig("quantized", num_speculations=4, lookup_first=True), cal, costs, tokens=seq, start=4)
    assert (guessed.steps, guessed.drafted, guessed.accepted) == (plain.steps, plain.drafted, plain.accepted)
    assert guessed.time_s < plain.time_s


@pytest.fixture(scope="module")
def tiny():
    hf = build_hf("llama", seed=3, num_layers=6, vocab_size=48)
    return selfspec.load(hf, dtype="float32")


@pytest.fixture(scope="module")
def calibration(tiny):
    from selfspec.search import Calibration

    ps = prompts(vocab=48, n=3, lengths=(12, 20, 8))
    ps.append([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7])
    return Calibration(tiny, ps, N_NEW), ps


@pytest.mark.parametrize("cfg", [
    DraftConfig("early-exit", exit_layer=3, num_speculations=4),
    DraftConfig("early-exit", exit_layer=1, num_speculations=8),
    DraftConfig("early-exit", exit_layer=5, num_speculations=3, draft_threshold=0.2),
    DraftConfig("prompt-lookup", num_speculations=3),
    DraftConfig("prompt-lookup", num_speculations=8, max_ngram=1),
    DraftConfig("early-exit", exit_layer=2, num_speculations=4, lookup_first=True),
    DraftConfig("early-exit", exit_layer=4, num_speculations=6, lookup_first=True, max_ngram=1),
], ids=lambda c: f"{c.strategy}-{c.exit_layer}-{c.num_speculations}-{c.draft_threshold}-{c.lookup_first}-{c.max_ngram}")
def test_prediction_replays_the_engine_exactly(tiny, calibration, cfg, monkeypatch):
    """Step by step: (drafted, accepted) of every verify step of the replay against the engine's."""
    from selfspec.predictor.simulate import Prediction
    from selfspec.search import predict

    cal, ps = calibration
    replayed, real = [], []
    step = Prediction.step
    monkeypatch.setattr(Prediction, "step", lambda self, d, n, t: (replayed.append((d, n)), step(self, d, n, t))[1])
    pred = predict(cfg, cal, tiny.cost_model())
    stats = []
    for p in ps:  # each generation its own drafter, watched at every verify step
        drafter = tiny.drafter(cfg)
        accepted = drafter.accepted
        drafter.accepted = lambda st, draft, n, accepted=accepted: (real.append((len(draft.tokens), n)), accepted(st, draft, n))[1]
        stats.append(generate(tiny.runtime, drafter, tiny.encode(p), ar_gen(N_NEW), SamplingConfig(), tiny.tokenizer,
                              tiny.eos_token_ids).stats)
    assert len(real) == sum(s.verify_steps for s in stats) and pred.tokens == sum(s.new_tokens - 1 for s in stats)
    assert sum(n for _, n in real) > 0, "nothing accepted: a replay of rejections only proves little"
    if cfg.draft_threshold is None:
        assert replayed == real
    else:
        # Drafts after a rejected one follow a wrong token: their confidences, and so where a
        # threshold stops them, are not in the teacher-forced replay (it models them). Up to
        # and including the first rejected draft every step must match, which needs every
        # confidence clear of the threshold by more than rounding (the replay computes rows
        # together, the engine one at a time):
        margin = min(float(np.abs(sig.conf - cfg.draft_threshold).min()) for sig in cal.signals(("exit", cfg.exit_layer), None))
        assert margin > 1e-4, "precondition: a threshold away from every confidence"
        clipped = lambda steps: [(min(d, n + 1), n) for d, n in steps]  # noqa: E731
        assert clipped(replayed) == clipped(real)
        assert min(float(sig.conf.min()) for sig in cal.signals(("exit", cfg.exit_layer), None)) < cfg.draft_threshold


def test_measured_costs_live_in_the_costs_dir(tmp_path, monkeypatch):
    """SELFSPEC_COSTS_DIR (the suite sets a temporary one) holds the measured costs, and a new
    load of the same model reads them back instead of measuring again."""
    from selfspec.predictor.costs import CostModel as Costs

    monkeypatch.setenv("SELFSPEC_COSTS_DIR", str(tmp_path / "costs"))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    hf = build_hf("llama", seed=8, num_layers=2)
    costs = selfspec.load(hf, dtype="float32").cost_model()
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1 and not (tmp_path / "cache").exists()
    monkeypatch.setattr(Costs, "measure", lambda *a, **k: pytest.fail("measured again"))
    again = selfspec.load(hf, dtype="float32").cost_model()
    assert again.to_dict() == costs.to_dict()


def test_costs_timed_on_a_busy_machine_are_measured_again_and_not_kept(tmp_path, monkeypatch, caplog):
    """Timings taken while other processes ran can be tens of times too high in places (a kept
    file once priced the int8 draft's layers at 150x the model's own: auto never drafted).
    Such a table is measured again; one still implausible is used by this process only; one
    kept on disk is ignored."""
    from selfspec.predictor import costs as C

    monkeypatch.setenv("SELFSPEC_COSTS_DIR", str(tmp_path / "costs"))
    hf = build_hf("llama", seed=8, num_layers=2)
    m = selfspec.load(hf, dtype="float32")
    good = m.cost_model()
    assert good.implausible() is None
    busy = CostModel(**{**good.__dict__, "attn": {**good.attn, 2: 89 * good.attn[1]}})
    assert "attention over 2 rows" in busy.implausible()
    assert "int8 sub-layer" in CostModel(**{**good.__dict__, "quant_layers": {8: (150 * good.attn[1], good.mlp[1])}}).implausible()
    assert "draft head" in CostModel(**{**good.__dict__, "draft_heads": {64: 10 * good.head[1]}}).implausible()

    stored = next((tmp_path / "costs").glob("*.json"))
    d = json.loads(stored.read_text())
    stored.write_text(json.dumps({**d, "costs": busy.to_dict()}))
    ident = d["identity"]
    assert C.load_stored(ident, C.FORMAT) is not None and C.load_costs(ident) is None  # a busy file: ignored

    calls = []
    def measure(*a, **k):  # busy twice, then quiet
        calls.append(1)
        return busy if len(calls) < 3 else good
    monkeypatch.setattr(CostModel, "measure", measure)
    assert selfspec.load(hf, dtype="float32").cost_model().to_dict() == good.to_dict() and len(calls) == 3
    assert C.load_costs(ident).to_dict() == good.to_dict()  # kept

    stored.unlink()
    calls.clear()
    monkeypatch.setattr(CostModel, "measure", lambda *a, **k: calls.append(1) or busy)
    with caplog.at_level("WARNING", logger="selfspec"):
        assert selfspec.load(hf, dtype="float32").cost_model() is busy
    assert len(calls) == 3 and not stored.exists() and "busy" in caplog.text  # this process only


def test_lookup_continuation():
    assert lookup_continuation([1, 2, 3, 9, 1, 2], 3, 2) == [3, 9]
    assert lookup_continuation([1, 2, 3, 4], 3, 2) == []
    assert lookup_continuation([5, 1, 7, 5, 2, 5], 1, 3) == [2, 5]  # most recent occurrence
    assert lookup_continuation([1, 1], 2, 0) == []


# ---- auto ----------------------------------------------------------------------------------------


def _ideal(num_layers=6, dead_from=2, seed=1):
    """Layers >= dead_from add nothing (zeroed output projections): early exit at dead_from
    is always right."""
    hf = build_hf("llama", seed=seed, num_layers=num_layers)
    with torch.no_grad():
        for layer in hf.model.layers[dead_from:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return selfspec.load(hf, dtype="float32")


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_is_lossless_every_arch(zoo, arch):
    _, m = zoo.get(arch)
    drafted = 0
    for p in prompts(n=2, lengths=(9, 14)):
        ar = ar_generate(m, p, max_new_tokens=N_NEW)
        for cfg in (DraftConfig("auto"), DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=1, num_speculations=6)),
                    DraftConfig("auto", base=DraftConfig("layer-skip", skip_mlp=(0, 2)))):
            out = m.generate(p, max_new_tokens=N_NEW, draft=cfg)
            assert out.token_ids == ar.token_ids, cfg
            drafted += out.stats.drafted
    assert drafted > 0  # auto's drafts were verified, not only plain steps compared


def test_auto_sampling_reproducible_for_a_seed(zoo):
    _, m = zoo.get("llama")
    p = prompts(n=1, lengths=(10,))[0]
    cfg = DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=2, num_speculations=4))
    a = m.generate(p, max_new_tokens=N_NEW, temperature=0.9, top_k=20, seed=11, draft=cfg)
    b = m.generate(p, max_new_tokens=N_NEW, temperature=0.9, top_k=20, seed=11, draft=cfg)
    assert a.token_ids == b.token_ids


def _auto(m, base_cfg, costs, **kw) -> AutoDrafter:
    from selfspec.drafters import make_drafter

    return AutoDrafter(m.runtime, DraftConfig("auto"), base=make_drafter(m.runtime, base_cfg), costs=costs, timing=False, **kw)


def test_auto_falls_back_when_drafts_are_bad(zoo):
    """A random tiny model's early exit at layer 1 is rarely right; with drafting as costly
    as on the real model (c = 0.6), auto must decode plainly most of the time and only probe
    with k = 1 now and then (the back-off doubles)."""
    from selfspec.engine import generate

    _, m = zoo.get("llama", seed=2, num_layers=6)
    p = prompts(n=1, lengths=(10,))[0]
    bad = DraftConfig("early-exit", exit_layer=1, num_speculations=8)
    costs = _fake_costs(L=6, layer=1.0, head=4.0)  # a draft token: 1 layer + a 4-layer head = 0.5 of a step
    costs.draft_heads.clear()
    costs.attn = {r: 0.5 * (1 + 0.3 * (r - 1)) for r in costs.attn}  # verifying more rows costs more
    d = _auto(m, bad, costs)
    ar = ar_generate(m, p, max_new_tokens=120)
    out = generate(m.runtime, d, p, ar_gen(120), SamplingConfig())
    assert out.token_ids == ar.token_ids
    assert out.stats.acceptance_rate < 0.3
    assert d.decisions.count(0) > 0.7 * len(d.decisions), d.decisions
    assert max(d.decisions) <= 2, d.decisions
    assert d.backoff > AutoDrafter.BASE_BACKOFF  # failed probes back off further


def test_auto_keeps_drafting_when_drafts_are_good():
    from selfspec.engine import generate

    m = _ideal(dead_from=2)
    p = prompts(n=1, lengths=(10,))[0]
    d = _auto(m, DraftConfig("early-exit", exit_layer=2, num_speculations=6), _fake_costs(L=6, head=1.0))
    out = generate(m.runtime, d, p, ar_gen(60), SamplingConfig())
    assert out.token_ids == ar_generate(m, p, max_new_tokens=60).token_ids
    assert d.decisions.count(0) <= 1 and out.stats.acceptance_rate > 0.95
    assert max(d.decisions) == 6  # with everything accepted, the longest draft is predicted best


def _timed_auto(m, base_cfg, costs, draft_factor, verify_factor):
    """auto on a virtual clock: each step's draft takes its modelled time x draft_factor(step),
    its verification the modelled time x verify_factor(step)."""
    from selfspec.drafters import make_drafter

    now, steps = [0.0], [0]
    d = AutoDrafter(m.runtime, DraftConfig("auto"), base=make_drafter(m.runtime, base_cfg), costs=costs,
                    clock=lambda: now[0])
    base_draft, base_verify = d.base.draft, d.base.verify

    def draft(step):
        now[0] += step.k * d._draft_s * draft_factor(steps[0])
        return base_draft(step)

    def verify(step, dr):
        now[0] += d._verify_s[len(dr.tokens)] * verify_factor(steps[0])
        steps[0] += 1
        return base_verify(step, dr)

    d.base.draft, d.base.verify = draft, verify
    return d


def test_auto_tells_a_drifting_machine_from_a_dear_draft():
    """Drafting pays ~1.9x here by the costs. A machine that slows 3x (and jitters) slows the
    draft and the verification alike: auto keeps drafting. A draft that costs 4x its model
    while verification costs what it should does not pay: auto learns it and decodes plainly."""
    from selfspec.engine import generate

    m = _ideal(dead_from=2)
    p = prompts(n=1, lengths=(10,))[0]
    base = DraftConfig("early-exit", exit_layer=2, num_speculations=6)
    ar = ar_generate(m, p, max_new_tokens=160).token_ids

    def drift(i):
        return (1.0 if i < 3 else 3.0) * (1.8 if i % 3 == 1 else 1.0)

    d = _timed_auto(m, base, _fake_costs(L=6, head=1.0), drift, drift)
    out = generate(m.runtime, d, p, ar_gen(160), SamplingConfig())
    assert out.token_ids == ar
    assert d.decisions.count(0) <= 1 and 0.7 < d.rho < 1.4, (d.decisions, d.rho)  # the last step may have no room

    d = _timed_auto(m, base, _fake_costs(L=6, head=1.0), lambda i: 4.0, lambda i: 1.0)
    out = generate(m.runtime, d, p, ar_gen(160), SamplingConfig())
    assert out.token_ids == ar
    assert d.rho > 2.5 and d.decisions.count(0) > 0.6 * len(d.decisions), (d.decisions, d.rho)


def test_auto_prices_a_copys_tail_by_the_rows_it_adds():
    """tail_room: the copied tail (Draft.tail) that maximises the step's predicted rate. Rows
    that cost nothing more (bandwidth-bound verification): all the room; rows that each cost
    as much as the step's own verification: none; a tail the copies keep getting wrong: none."""
    from selfspec.drafters import make_drafter

    m = _ideal()
    base = make_drafter(m.runtime, DraftConfig("early-exit", exit_layer=2, num_speculations=4))

    def auto(costs, tail=None):
        d = AutoDrafter(m.runtime, DraftConfig("auto"), base=base, costs=costs)
        d._reset()
        d._model_costs()
        d.A, d.R = 9.0, 1.0
        if tail is not None:
            d.At, d.Rt = tail
        return d

    rows = (1, 2, 3, 5, 9, 17)
    dear = CostModel(6, {r: r / 2 for r in rows}, {r: r / 2 for r in rows}, {r: float(r) for r in rows}, {100: 0.5})
    assert auto(_fake_costs(L=6, head=1.0)).tail_room(4, 12) == 12
    assert auto(_fake_costs(L=6, head=1.0)).tail_room(4, 3) == 3
    assert auto(_fake_costs(L=6, head=1.0)).tail_room(4, 0) == 0
    assert auto(dear).tail_room(4, 12) == 0
    assert auto(_fake_costs(L=6, head=1.0), tail=(0.0, 5.0)).tail_room(4, 12) == 0
    # rows that get dearer past 9: the tail stops where the next rows cost more than they bring
    knee = CostModel(6, {1: 0.5, 2: 0.5, 3: 0.5, 5: 0.5, 9: 0.5, 17: 4.0}, {1: 0.5, 2: 0.5, 3: 0.5, 5: 0.5, 9: 0.5, 17: 4.0},
                     {r: 1.0 for r in rows}, {100: 0.5})
    assert 0 < auto(knee, tail=(9.0, 1.0)).tail_room(4, 12) < 12


def ar_gen(n):
    from selfspec.config import GenerationConfig

    return GenerationConfig(n)


def test_auto_drafts_on_an_ideal_model():
    """Calibration picks the exit that is always right and auto keeps drafting. Its decisions
    come from costs, so the costs are fixed here (a draft token: 2 layers + a 1-layer head,
    against 7 for a step) and the online correction by observed step times is off."""
    m = _ideal()
    m.resources.cost_model = lambda heads=(), bits=(): _fake_costs(L=6, head=1.0)
    d = m.drafter(DraftConfig("auto"))
    d.timing = False
    p = prompts(n=1, lengths=(24,))[0]
    ar = ar_generate(m, p, max_new_tokens=64)
    out = generate(m.runtime, d, p, ar_gen(64), SamplingConfig())
    assert out.token_ids == ar.token_ids
    assert out.stats.draft["source"] == "calibrated" and out.stats.draft["draft"] == d.base.cfg.to_dict()
    assert d.base.cfg.strategy == "early-exit" and d.base.cfg.exit_layer <= 2, d.base.cfg
    assert out.stats.acceptance_rate > 0.95
    assert out.stats.mean_accepted_length > 3
    assert sum(1 for k in d.decisions if k == 0) <= 2


@pytest.mark.skipif(not kernels.available(), reason="quantized drafting needs the kernels")
def test_auto_calibration_considers_the_quantized_copy():
    """On a random model early exits disagree with the last layer while an int8 copy of its
    weights agrees: with costs where the copy is cheap, calibration picks it. Scoring it writes
    the copy's rows into the prefill's cache and puts the verifier's back: the output equal to
    plain decoding shows they were."""
    m = selfspec.load(build_hf("llama", seed=5, num_layers=6), dtype="float32")
    costs = _fake_costs(L=6, head=1.0)
    costs.quant_layers[8] = (0.1, 0.1)
    m.resources.cost_model = lambda heads=(), bits=(): costs
    d = m.drafter(DraftConfig("auto"))
    d.timing = False
    p = prompts(n=1, lengths=(24,), seed=3)[0]
    out = generate(m.runtime, d, p, ar_gen(48), SamplingConfig())
    assert out.token_ids == ar_generate(m, p, max_new_tokens=48).token_ids
    assert d.base.cfg.strategy == "quantized" and d.base.cfg.draft_bits == 8, d.base.cfg
    # a random model's flat distributions make near-ties an int8 copy flips (~98% agreement on Gemma)
    assert out.stats.draft["source"] == "calibrated" and out.stats.acceptance_rate > 0.5


def test_auto_uses_an_installed_profile(tmp_path, monkeypatch):
    from selfspec.profiles import install_profile

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    m = _ideal(seed=7)
    prof = Profile(DraftConfig("early-exit", exit_layer=3, num_speculations=5), m.fingerprint, "ideal")
    path = install_profile(prof)
    assert path.exists()
    out = m.generate(prompts(n=1, lengths=(12,))[0], max_new_tokens=20, strategy="auto")
    assert out.stats.draft["draft"] == prof.draft.to_dict() and out.stats.draft["source"] == "profile"
    assert out.stats.draft["label"] == f"auto: {prof.draft.label()} (profile)"
    assert out.stats.drafted > 0


def test_auto_starts_from_the_acceptance_its_profile_measured(tmp_path, monkeypatch):
    from selfspec.drafters.factory import profile_prior
    from selfspec.profiles import install_profile

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    m = _ideal(seed=7)
    draft = DraftConfig("early-exit", exit_layer=3, num_speculations=5)
    assert profile_prior(Profile(draft, m.fingerprint, "ideal")) is None  # nothing measured: auto's own prior
    assert profile_prior(Profile(draft, m.fingerprint, "ideal", {"acceptance_rate": 1.0})) is None
    install_profile(Profile(draft, m.fingerprint, "ideal", {"acceptance_rate": 0.5, "measured_acceptance_rate": 0.9}))
    d = m.drafter(DraftConfig("auto"))
    d._reset()
    assert d.A / (d.A + d.R) == pytest.approx(0.9) and d.A + d.R == pytest.approx(AutoDrafter.PRIOR_WEIGHT)
    p = prompts(n=1, lengths=(12,))[0]
    out = m.generate(p, max_new_tokens=20, strategy="auto")
    assert out.token_ids == ar_generate(m, p, max_new_tokens=20).token_ids and out.stats.draft["source"] == "profile"


def test_auto_over_a_profile_takes_lookup_matches_in_greedy_decoding_only(tmp_path, monkeypatch):
    """auto wraps a profile's self-draft in a greedy-only lookup-first: the prompt lookup is
    consulted first in greedy decoding (a match drafts for free); when sampling (a copied token is accepted with
    probability p(x) only) the lookup is never consulted. Lossless and seed-exact either way; copied
    drafts leave auto's acceptance estimate alone."""
    from selfspec.batch.sequence import kind_of
    from selfspec.drafters import LookupFirstDrafter
    from selfspec.profiles import install_profile

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    m = _ideal(seed=7)
    install_profile(Profile(DraftConfig("early-exit", exit_layer=3, num_speculations=4), m.fingerprint, "ideal"))
    m.resources.cost_model = lambda heads=(), bits=(): _fake_costs(L=6, head=1.0)  # drafting pays (test_auto_drafts_on_an_ideal_model)
    p = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9]  # repeats: the lookup has matches
    for temperature, seed in ((0.0, None), (0.9, 3)):
        d = m.drafter(DraftConfig("auto"))
        d.timing = False
        assert isinstance(d.base, LookupFirstDrafter) and d.base.greedy_only
        assert kind_of(d) == "depth"  # a batch drafts the self-draft in one forward with the others
        found, estimates = [], []
        real, real_accepted = d.base.lookup.draft, d.accepted
        d.base.lookup.draft = lambda step: found.append(real(step)) or found[-1]

        def accepted(step, draft, n):
            before = (d.A, d.R)
            real_accepted(step, draft, n)
            estimates.append((draft.copied, before == (d.A, d.R)))

        d.accepted = accepted
        sampling = SamplingConfig(temperature=temperature, seed=seed)
        out = generate(m.runtime, d, p, ar_gen(24), sampling)
        if temperature == 0:
            assert out.token_ids == ar_generate(m, p, max_new_tokens=24).token_ids
            assert len(found) > 0 and out.stats.drafted > 0  # consulted at every drafting step
            assert any(c for c, _ in estimates) and all(same for c, same in estimates if c)  # copies: estimate untouched
            assert any(not same for c, same in estimates if not c)  # its own drafts: learnt from
        else:
            assert found == [] and out.stats.drafted > 0 and not any(c for c, _ in estimates)
            again = m.generate(p, max_new_tokens=24, strategy="auto", temperature=temperature, seed=seed)
            assert again.token_ids == out.token_ids


def test_auto_config_validation():
    with pytest.raises(SelfSpecError, match="base is not used by the early-exit strategy"):
        DraftConfig("early-exit", exit_layer=1, base=DraftConfig("prompt-lookup"))
    with pytest.raises(SelfSpecError, match="cannot gate"):
        DraftConfig("auto", base=DraftConfig("auto"))
    cfg = DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=2))
    assert DraftConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# ---- exit adapters at inference ------------------------------------------------------------------


def _adapter(m, E=2, seed=0, scale=0.5, fingerprint=None, heads=0) -> ExitAdapter:
    a = ExitAdapter(AdapterMeta(exit_layer=E, hidden_size=m.spec.hidden_size, inner_size=16,
                                model_fingerprint=m.fingerprint if fingerprint is None else fingerprint, heads=heads, head_dim=8))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        a.down.copy_(torch.randn(a.down.shape, generator=g) * scale)
        if heads:
            a.out.copy_(torch.randn(a.out.shape, generator=g) * scale)
    return a


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("heads", [0, 2])
def test_exit_adapter_is_lossless(zoo, tmp_path, arch, heads):
    _, m = zoo.get(arch)
    path = tmp_path / "adapter.safetensors"
    a = _adapter(m, heads=heads)
    save_adapter(a, path)
    loaded = load_adapter(path)
    assert loaded.meta == a.meta and loaded.meta.exit_layer == 2
    h = torch.randn(2, 5, m.spec.hidden_size)
    with torch.no_grad():
        assert torch.equal(loaded(h), a(h))
    for p in prompts(n=2, lengths=(7, 12)):
        ar = ar_generate(m, p, max_new_tokens=N_NEW)
        out = m.generate(p, max_new_tokens=N_NEW, strategy="exit-adapter", adapter=str(path), num_speculations=5)
        assert out.token_ids == ar.token_ids
        lk = m.generate(p, max_new_tokens=N_NEW, strategy="exit-adapter", adapter=str(path), num_speculations=3, lookup_first=True)
        assert lk.token_ids == ar.token_ids
        s = m.generate(p, max_new_tokens=N_NEW, strategy="exit-adapter", adapter=str(path), temperature=0.8, seed=3)
        s2 = m.generate(p, max_new_tokens=N_NEW, strategy="exit-adapter", adapter=str(path), temperature=0.8, seed=3)
        assert s.token_ids == s2.token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_exit_adapter_bfloat16_fast_path(zoo, tmp_path, arch):
    """On the bf16 kernel runtime the adapter's matmuls go through the kernel with bf16 copies
    of its weights: the same function up to bf16 rounding, and still lossless."""
    from selfspec.drafters import ExitAdapterDrafter

    _, m = zoo.get(arch, dtype="bfloat16")
    a = _adapter(m)
    path = tmp_path / "adapter.safetensors"
    save_adapter(a, path)
    d = ExitAdapterDrafter(m.runtime, DraftConfig("exit-adapter", exit_layer=2, adapter=str(path)), adapter=a)
    assert (d._matmul is kernels.matmul) == m.runtime.uses_kernels
    h = torch.randn(3, m.spec.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        fast, ref = d._head_input(h, 0).float(), a(h).float()
    assert (fast - ref).abs().max().item() <= 0.03 * ref.abs().max().item()
    for p in prompts(n=2, lengths=(7, 12)):
        ar = ar_generate(m, p, max_new_tokens=N_NEW)
        out = m.generate(p, max_new_tokens=N_NEW, strategy="exit-adapter", adapter=str(path), num_speculations=3)
        assert out.token_ids == ar.token_ids


def test_adapter_attention_with_a_cache_equals_the_whole_sequence():
    """Drafting feeds the adapter a few positions at a time through its cache; training runs
    whole sequences causally. Both must be the same function."""
    a = ExitAdapter(AdapterMeta(exit_layer=2, hidden_size=32, inner_size=16, heads=4, head_dim=8))
    with torch.no_grad():
        a.out.normal_(0, 0.5)
        a.down.normal_(0, 0.5)
        h = torch.randn(11, 32)
        whole = a(h)
        cache, parts, pos = AdapterCache(a.meta, 16, "cpu"), [], 0
        for t in (4, 1, 1, 3, 2):
            parts.append(a.block(h[pos : pos + t], a.weights(), torch.matmul, pos, cache))
            pos += t
        torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)
        # batched sequences are independent sequences from position 0
        torch.testing.assert_close(a(torch.stack([h, h.flip(0)]))[1], a(h.flip(0)), atol=1e-5, rtol=1e-5)
        # a query never sees later positions: changing the last input changes only the last output
        h2 = h.clone()
        h2[-1] += 1.0
        assert torch.equal(a(h2)[:-1], whole[:-1])


@pytest.mark.parametrize("mode", ["plain", "lookup_first", "auto_calibrated", "sampling"])
def test_adapter_keys_and_values_cover_every_position(zoo, mode):
    """Whatever path a position took (prompt, draft input, verification, prompt-lookup
    drafts, auto's plain steps after a prefill the adapter did not run), the adapter's cache
    ends up holding what one pass over the whole context writes. Acceptance depends on it;
    losslessness does not, so only this test can catch a gap."""
    from selfspec.config import GenerationConfig
    from selfspec.drafters import ExitAdapterDrafter, LookupFirstDrafter
    from selfspec.engine import generate

    _, m = zoo.get("llama")
    a = _adapter(m, heads=2)
    cfg = DraftConfig("exit-adapter", exit_layer=2, adapter="unused", num_speculations=3)
    inner = ExitAdapterDrafter(m.runtime, cfg, adapter=a)
    drafter = {"plain": inner, "sampling": inner, "lookup_first": LookupFirstDrafter(inner, cfg.replace(lookup_first=True)),
               "auto_calibrated": AutoDrafter(m.runtime, DraftConfig("auto"), costs=_fake_costs(L=m.spec.num_layers, draft_head=0.01),
                                              choose_base=lambda ids, captured, cache: (inner, 0.9), timing=False)}[mode]
    ids = [int(t) for t in torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(1))] * 2  # repeats: lookup matches
    sampling = SamplingConfig(temperature=0.9, seed=2) if mode == "sampling" else SamplingConfig()
    out = generate(m.runtime, drafter, ids, GenerationConfig(max_new_tokens=N_NEW), sampling)
    assert out.stats.drafted > 0
    context = torch.tensor(ids + out.token_ids[:-1])  # every token that was an input
    n = len(context)
    assert inner._kv_len >= n
    with torch.inference_mode():
        rt = m.runtime
        h = rt.run_layers(rt.embed(context), 0, 2, 0, rt.new_cache(n))
        ref = AdapterCache(a.meta, n, "cpu")
        a.block(h, a.weights(), torch.matmul, 0, ref)
    torch.testing.assert_close(inner._kv.k[:, :n], ref.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inner._kv.v[:, :n], ref.v, atol=1e-5, rtol=1e-5)


def test_untrained_adapter_equals_plain_early_exit(zoo, tmp_path):
    _, m = zoo.get("llama")
    a = ExitAdapter(AdapterMeta(exit_layer=2, hidden_size=m.spec.hidden_size, inner_size=8, model_fingerprint=m.fingerprint))
    path = tmp_path / "zero.safetensors"
    save_adapter(a, path)
    p = prompts(n=1, lengths=(9,))[0]
    ee = m.generate(p, max_new_tokens=N_NEW, strategy="early-exit", exit_layer=2)
    ad = m.generate(p, max_new_tokens=N_NEW, strategy="exit-adapter", adapter=str(path))
    assert (ee.stats.drafted, ee.stats.accepted) == (ad.stats.drafted, ad.stats.accepted)


def test_exit_adapter_errors(zoo, tmp_path):
    _, m = zoo.get("llama")
    p = prompts(n=1, lengths=(5,))[0]
    other = tmp_path / "other.safetensors"
    save_adapter(_adapter(m, fingerprint="0123456789abcdef"), other)
    with pytest.raises(SelfSpecError, match="another model"):
        m.generate(p, max_new_tokens=4, strategy="exit-adapter", adapter=str(other))
    good = tmp_path / "good.safetensors"
    save_adapter(_adapter(m), good)
    with pytest.raises(SelfSpecError, match="exit layer 2, not 3"):
        m.generate(p, max_new_tokens=4, strategy="exit-adapter", adapter=str(good), exit_layer=3)
    with pytest.raises(SelfSpecError, match="not found"):
        m.generate(p, max_new_tokens=4, strategy="exit-adapter", adapter=str(tmp_path / "missing.safetensors"))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(SelfSpecError, match="cannot read exit adapter"):
        m.generate(p, max_new_tokens=4, strategy="exit-adapter", adapter=str(junk))
    with pytest.raises(SelfSpecError, match="needs --adapter"):
        DraftConfig("exit-adapter")


def test_profile_resolves_a_relative_adapter_path(zoo, tmp_path):
    _, m = zoo.get("llama")
    save_adapter(_adapter(m), tmp_path / "a.safetensors")
    prof = tmp_path / "profile.json"
    save_profile(Profile(DraftConfig("exit-adapter", exit_layer=2, adapter="a.safetensors"), m.fingerprint), prof)
    loaded = load_profile(prof, m.fingerprint)
    assert Path(loaded.draft.adapter) == (tmp_path / "a.safetensors").resolve()
    out = m.generate([3, 4, 5], max_new_tokens=8, profile=str(prof))
    assert out.token_ids == ar_generate(m, [3, 4, 5], max_new_tokens=8).token_ids


# ---- selfspec search -----------------------------------------------------------------------------


@pytest.mark.skipif(not kernels.available(), reason="quantized drafting needs the kernels")
@pytest.mark.parametrize("cfg", [DraftConfig("quantized", num_speculations=4),
                                 DraftConfig("quantized", draft_bits=4, exit_layer=5, skip_mlp=(2,), num_speculations=3)],
                         ids=["int8", "int4-E5-skip"])
def test_quantized_prediction_tracks_the_engine(tiny, calibration, cfg):
    """The replay scores the copy teacher-forced over its own keys/values, where the engine's
    drafts read the verifier's for committed positions: not step-exact as the exits above, but
    the acceptance it predicts must track the engine's."""
    from selfspec.search import predict

    cal, ps = calibration
    pred = predict(cfg, cal, tiny.resources.cost_model(heads=(cfg.draft_head(),), bits=(cfg.draft_bits,)))
    outs = [tiny.generate(p, max_new_tokens=N_NEW, draft=cfg) for p in ps]
    accepted, drafted = sum(o.stats.accepted for o in outs), sum(o.stats.drafted for o in outs)
    assert drafted > 0 and pred.drafted > 0
    assert abs(pred.acceptance_rate - accepted / drafted) < 0.15, (pred.acceptance_rate, accepted, drafted)


@pytest.fixture(scope="module")
def search_model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("search") / "tiny"
    d.mkdir()
    build_hf("llama", seed=0, num_layers=6).save_pretrained(d)
    word_tokenizer(VOCAB).save_pretrained(d)
    return d


def _search(model_dir, out_dir, *extra, timeout=300):
    return run_cli("search", "--model", str(model_dir), "--num-samples", "1", "--max-new-tokens", "12",
                   "--out-dir", str(out_dir), *extra, timeout=timeout)


def test_search_writes_a_usable_profile_and_resumes(search_model_dir, tmp_path):
    out = tmp_path / "s"
    r = _search(search_model_dir, out, "--n-trials", "6", "--dataset", "code")
    assert r.returncode == 0, r.stderr
    prof = json.loads((out / "profile.json").read_text())
    assert prof["draft"]["strategy"] in ("early-exit", "layer-skip", "prompt-lookup", "quantized")  # the search space's families
    assert prof["metrics"]["identical_to_autoregressive"] is True
    assert prof["metrics"]["measured_speedup"] > 0 and "predicted_speedup" in prof["metrics"]
    assert (out / "history.png").stat().st_size > 1000
    summary = json.loads((out / "search.json").read_text())
    assert len(summary["trials"]) == 6
    # the profile works with generate
    g = run_cli("generate", "a b c", "--model", str(search_model_dir), "--profile", str(out / "profile.json"),
                "--max-new-tokens", "5", "--json")
    assert g.returncode == 0, g.stderr
    # resuming the same study: only the missing trials run, the finished ones are kept
    r2 = _search(search_model_dir, out, "--n-trials", "9", "--dataset", "code", "--no-confirm")
    assert r2.returncode == 0, r2.stderr
    trials = json.loads((out / "search.json").read_text())["trials"]
    assert len(trials) == 9
    assert {t["number"] for t in summary["trials"]} <= {t["number"] for t in trials}


def test_search_two_workers_share_one_study(search_model_dir, tmp_path):
    out = tmp_path / "w"
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    r = _search(search_model_dir, out, "--n-trials", "8", "--workers", "2", "--storage", storage, "--no-confirm",
                "--dataset", "code")
    assert r.returncode == 0, r.stderr  # the worker process exited 0 too (else the run fails)
    summary = json.loads((out / "search.json").read_text())
    trials = summary["trials"]
    assert len(trials) >= 8 and {t["worker"] for t in trials} <= {0, 1}
    # Both processes joined the one study (each leaves its start-line marker in it). How the
    # trials split between them is scheduling: a worker that finishes calibrating first may
    # run them all, so that is not asserted.
    import optuna

    study = optuna.load_study(study_name=summary["metrics"]["study_name"], storage=storage)
    assert {k.split("_")[1] for k in study.user_attrs if k.startswith("ready_")} == {"0", "1"}, study.user_attrs


@pytest.mark.skipif(not kernels.available(), reason="quantized drafting needs the kernels")
def test_search_the_quantized_family(search_model_dir, tmp_path):
    out = tmp_path / "q"
    r = _search(search_model_dir, out, "--n-trials", "5", "--dataset", "code", "--strategies", "quantized")
    assert r.returncode == 0, r.stderr
    prof = json.loads((out / "profile.json").read_text())
    d = DraftConfig.from_dict(prof["draft"])
    assert d.strategy == "quantized" and d.draft_bits in (4, 8) and d.head_bits in (4, 8)
    assert prof["metrics"]["identical_to_autoregressive"] is True
    trials = json.loads((out / "search.json").read_text())["trials"]
    assert len(trials) == 5 and all(t["draft"]["strategy"] == "quantized" and t["c"] > 0 for t in trials)


@pytest.mark.parametrize("args, fragments", [
    (("--n-trials", "0"), ("at least 1 trial",)),
    (("--storage", "postgresql://nobody@127.0.0.1:1/none"), ("cannot open the study storage",)),
    (("--dataset", "missing.jsonl"), ("missing.jsonl",)),
    (("--strategies", "warp-drive"), ("search strategies",)),
    (("--objective", "vibes"), ("objective",)),
])
def test_search_bad_input(search_model_dir, tmp_path, args, fragments):
    assert_user_error(_search(search_model_dir, tmp_path / "bad", *args), *fragments)


def test_search_empty_calibration_set(search_model_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = _search(search_model_dir, tmp_path / "e", "--dataset", str(empty))
    assert_user_error(r)


def test_search_unwritable_out_dir(search_model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_user_error(_search(search_model_dir, blocker / "sub"), "cannot write")


def test_profile_for_another_model_is_refused(search_model_dir, tmp_path):
    prof = tmp_path / "p.json"
    save_profile(Profile(DraftConfig("prompt-lookup"), "0000000000000000"), prof)
    r = run_cli("generate", "a b", "--model", str(search_model_dir), "--profile", str(prof), "--strategy", "auto")
    assert_user_error(r, "another model")


@pytest.mark.parametrize("arch", ARCHS)
def test_lookup_first_is_lossless(zoo, tmp_path, arch):
    _, m = zoo.get(arch)
    save_adapter(_adapter(m), tmp_path / "a.safetensors")
    base = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]
    for p in (base, prompts(n=1, lengths=(9,))[0]):
        ar = ar_generate(m, p, max_new_tokens=N_NEW)
        for kw in (dict(strategy="early-exit", exit_layer=2, num_speculations=5),
                   dict(strategy="layer-skip", skip_mlp=(1,), num_speculations=3),
                   dict(strategy="exit-adapter", adapter=str(tmp_path / "a.safetensors"), draft_threshold=0.2, adaptive=True)):
            out = m.generate(p, max_new_tokens=N_NEW, lookup_first=True, **kw)
            assert out.token_ids == ar.token_ids, kw
            s = m.generate(p, max_new_tokens=N_NEW, lookup_first=True, temperature=0.9, seed=2, **kw)
            assert s.token_ids == m.generate(p, max_new_tokens=N_NEW, lookup_first=True, temperature=0.9, seed=2, **kw).token_ids
    with pytest.raises(SelfSpecError, match="lookup_first"):
        DraftConfig("prompt-lookup", lookup_first=True)


def test_sweep_and_bench_take_an_exit_adapter(search_model_dir, tmp_path):
    m = selfspec.load(str(search_model_dir), dtype="float32")
    path = tmp_path / "ad.safetensors"
    save_adapter(_adapter(m, E=3), path)
    r = run_cli("sweep", "--model", str(search_model_dir), "--strategy", "exit-adapter", "--adapter", str(path),
                "--num-speculations", "1,3", "--dataset", "code", "--num-samples", "1", "--max-new-tokens", "8",
                "--warmup", "0", "--no-progress", "--out-dir", str(tmp_path / "sw"))
    assert r.returncode == 0, r.stderr
    sweep = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert {c["draft"]["exit_layer"] for c in sweep["cells"]} == {3}
    b = run_cli("bench", "--model", str(search_model_dir), "--strategy", "exit-adapter", "--adapter", str(path),
                "--dataset", "code", "--num-samples", "1", "--max-new-tokens", "8", "--warmup", "0", "--no-progress",
                "--out", str(tmp_path / "b.json"))
    assert b.returncode == 0, b.stderr
    assert_user_error(run_cli("sweep", "--model", str(search_model_dir), "--strategy", "exit-adapter"), "--adapter")


def test_a_search_whose_winner_loses_says_so_and_refuses_to_install(search_model_dir, tmp_path, monkeypatch, capsys):
    """Issue 19: the confirmation measured the winner slower than plain decoding."""
    from selfspec import profiles
    from selfspec import search as S
    from selfspec.cli import main

    real = S.measure

    def slow(model, cfg, prompts, max_new_tokens, repeats=1):
        m = real(model, cfg, prompts, max_new_tokens, repeats)
        return {**m, "measured_speedup": 0.62}  # the outputs are still compared for real

    monkeypatch.setattr(S, "measure", slow)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "s"
    rc = main(["search", "--model", str(search_model_dir), "--num-samples", "1", "--max-new-tokens", "8", "--dataset", "code",
               "--n-trials", "3", "--out-dir", str(out), "--install"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.err.strip().splitlines()[-1].startswith("selfspec: error: not installed")
    assert "SLOWER than autoregressive decoding (measured 0.62x)" in " ".join(cap.err.split())
    prof = load_profile(out / "profile.json")
    assert prof.metrics["slower_than_autoregressive"] is True and prof.metrics["speedup_vs_autoregressive"] == 0.62
    assert profiles.installed_profile(prof.model_fingerprint) is None
    assert (out / "history.png").stat().st_size > 1000 and (out / "search.json").exists()
    # each strategy the study tried: its best measured, the options it takes when named bare
    tried = {r["draft"]["strategy"] for r in json.loads((out / "search.json").read_text())["trials"]} - {"autoregressive"}
    assert tried and set(prof.strategies) == tried
    for name, entry in prof.strategies.items():
        assert entry["metrics"]["measured_speedup"] == 0.62 and entry["metrics"]["identical_to_autoregressive"] is True
        assert DraftConfig.from_dict({**entry["options"], "strategy": name}).label() == entry["metrics"]["label"]


def test_history_plot_names_its_objective_and_shows_the_measured_winner(tmp_path, monkeypatch):
    import matplotlib.axes

    from selfspec import search as S

    optuna = S._optuna()
    study = optuna.create_study(direction="maximize")
    for i, v in enumerate([0.6, 1.3, 0.9]):
        t = optuna.trial.create_trial(value=v, params={}, distributions={},
                                      user_attrs={"draft": DraftConfig("prompt-lookup", num_speculations=i + 1).to_dict()})
        study.add_trial(t)
    labels: dict[str, list[str]] = {"ylabel": [], "scatter": []}
    real_ylabel, real_scatter = matplotlib.axes.Axes.set_ylabel, matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel", lambda self, text, *a, **k: labels["ylabel"].append(text) or real_ylabel(self, text, *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", lambda self, *a, **k: labels["scatter"].append(k.get("label", "")) or real_scatter(self, *a, **k))
    S.plot_history(study, tmp_path / "h.png", "t", "predicted",
                   {"number": 1, "predicted_speedup": 1.3, "measured_speedup": 1.05})
    assert labels["ylabel"][-1].startswith("predicted speedup")
    assert any("measured against plain decoding: 1.05x" in lab for lab in labels["scatter"])
    assert any("(predicted)" in lab for lab in labels["scatter"])
    S.plot_history(study, tmp_path / "m.png", "t", "measured")
    assert labels["ylabel"][-1].startswith("measured speedup")
    assert (tmp_path / "h.png").stat().st_size > 1000 and (tmp_path / "m.png").stat().st_size > 1000


def test_installed_profile_is_read_again_when_its_file_changes(tmp_path, monkeypatch):
    """Profiles are parsed once per file version (a server builds auto's drafter per request);
    installing another profile for the model (a new file renamed over the old) is seen at once,
    and a caller changing the profile it got does not change the next caller's."""
    from selfspec.profiles import install_profile, installed_profile

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    fp = "f" * 16
    install_profile(Profile(DraftConfig("early-exit", exit_layer=3, num_speculations=4), fp, "m", {"acceptance_rate": 0.5}))
    first = installed_profile(fp)
    assert first.draft.exit_layer == 3
    first.metrics["acceptance_rate"] = 0.0
    assert installed_profile(fp).metrics["acceptance_rate"] == 0.5
    shared = installed_profile(fp, shared=True)  # auto's read-only view: parsed once, no copy
    assert shared is installed_profile(fp, shared=True) and shared.metrics["acceptance_rate"] == 0.5
    install_profile(Profile(DraftConfig("early-exit", exit_layer=5, num_speculations=4), fp, "m"))
    assert installed_profile(fp).draft.exit_layer == 5
    assert installed_profile(fp, shared=True).draft.exit_layer == 5
