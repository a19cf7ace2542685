"""The Gumbel-max pick through the int8-screened head (selfspec/sampled_head.py): the token is the
unscreened pick's on adversarial rows (ties, near-ties at the screen's precision, all-equal
logits, one huge logit, top-k boundaries), a bound made too tight is caught, and seeded outputs
of every strategy, solo and batched, are the stored texts of plain, unscreened decoding
(tests/data/seeded_outputs.json, written by the code before the screen: seeded_cases.py)."""

from __future__ import annotations

import json

import pytest
import torch

import seeded_cases
from selfspec import kernels, sampled_head
from selfspec.config import SamplingConfig
from selfspec.coupling import gumbel_noise, gumbel_token
from selfspec.greedy_head import ScreenedHead, screened_head
from selfspec.kernels.screen import exp_bound, gumbel_reach, nucleus_tail, screen_bounds

from test_greedy_head import LAYOUTS, _full, _head, _rows
from test_kernels import needs_kernels

pytestmark = needs_kernels

CFGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.05),
        SamplingConfig(temperature=3.0), SamplingConfig(temperature=0.7, top_k=5), SamplingConfig(temperature=1.0, top_k=1),
        SamplingConfig(temperature=0.8, top_k=300), SamplingConfig(temperature=0.8, top_p=0.9),
        SamplingConfig(temperature=0.8, top_p=0.5), SamplingConfig(temperature=1.0, top_p=1e-6),
        SamplingConfig(temperature=1.0, top_p=0.999999), SamplingConfig(temperature=0.05, top_p=0.95),
        SamplingConfig(temperature=0.7, top_k=5, top_p=0.8), SamplingConfig(temperature=1.3, top_k=300, top_p=0.95)]


def _adversarial(k: int, v: int, dtype, layout: str):
    """(head, rows x [M, k]): ties (column 7 repeated), near-ties one bf16 step apart, a column
    scaled 1e3 (one huge logit), all-equal logits (a zero row, and a row no column sees), rows
    aligned with column 7 and rows of plain noise."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(k, v, generator=g) / k**0.5
    w[:, 3] = w[:, 7]
    w[:, 11] = w[:, 7]
    w[:, 12] = w[:, 7] * (1 + 2.0**-8)  # a near-tie at bf16's precision
    w[:, 13] = w[:, 7] * (1 - 2.0**-20)  # below every precision the screen has
    w[:, 500] = w[:, 501] * 1e3
    w[:, 600:700] = w[:, 600:601]  # a hundred-way tie
    x = _rows(6, k, torch.float32, head=w.to(dtype))
    x[1] = 0.0  # every logit 0
    x[2] = w[:, 600] * 40  # the hundred-way tie on top
    x[3] = w[:, 501] / w[:, 501].norm()  # column 500 huge
    x[4, :] = 0.0
    x[4, 0] = 1e-3  # near-flat logits
    head = w.to(dtype) if layout == "plain" else kernels.pack(w.to(dtype), pairs=layout == "pairs")
    return head, x.to(dtype)


def _both(head, x, cfg, keys=range(12), pos0=100) -> tuple[list[int], list[int]]:
    sh = ScreenedHead.make(head)
    rows = sampled_head.HeadRows(x, sh, lambda x: _full(x, head))
    full = _full(x, head)
    got, want = [], []
    for i in range(x.shape[0]):
        for key in keys:
            got.append(gumbel_token(rows[i], cfg, key, pos0 + i))
            want.append(gumbel_token(full[i], cfg, key, pos0 + i))
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_adversarial_rows_pick_the_exact_token(monkeypatch, layout, dtype):
    if layout == "pairs" and dtype != torch.bfloat16:
        pytest.skip("the pair layout is bf16 only")
    monkeypatch.setattr(sampled_head, "SCREEN_TRUNCATED", True)
    head, x = _adversarial(128, 1500, dtype, layout)
    for cfg in CFGS:
        got, want = _both(head, x, cfg)
        assert got == want, cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_top_p_boundary_on_a_token(layout, dtype):
    """top_p set to the cumulative mass through the j-th largest token (and one fp64 step either
    side): the nucleus ends exactly on a token, where only the exact sums can decide."""
    if layout == "pairs" and dtype != torch.bfloat16:
        pytest.skip("the pair layout is bf16 only")
    head, x = _adversarial(128, 1500, dtype, layout)
    full = _full(x, head)
    for i in range(x.shape[0]):
        for t in (1.0, 0.8):
            cum = (full[i] / t).double().softmax(-1).sort(descending=True).values.cumsum(0)
            for j in (0, 1, 2, 5, 40):
                c = torch.tensor(float(cum[j]), dtype=torch.float64)
                for p in (c, c.nextafter(torch.tensor(0.0, dtype=torch.float64)), c.nextafter(torch.tensor(2.0, dtype=torch.float64))):
                    if 0.0 < float(p) < 1.0:
                        cfg = SamplingConfig(temperature=t, top_p=float(p))
                        got, want = _both(head, x[i : i + 1], cfg, keys=range(6), pos0=7 + i)
                        assert got == want, (i, t, j, float(p))


def test_the_screen_decides_most_rows():
    head, x = _adversarial(128, 1500, torch.bfloat16, "packed")
    for cfg in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_p=0.9),
                SamplingConfig(temperature=0.8, top_k=40)):
        sh = ScreenedHead.make(head)
        rows = sampled_head.HeadRows(x, sh, lambda x: _full(x, head))
        for i in range(x.shape[0]):
            gumbel_token(rows[i], cfg, 3, 9 + i)
        assert sh.picks == x.shape[0] and sh.pick_full <= 1 and sh.pick_computed < 1500 * x.shape[0] / 4, cfg


def test_nucleus_tail_sums():
    """csrc/gumbel.c's sums against torch's fp64, entries outside skip only: the mass above and
    the count an upper bound, the normaliser's part a lower one, both within 2^-17."""
    g = torch.Generator().manual_seed(4)
    up = torch.randn(5003, generator=g) * 3
    lo = up - torch.rand(5003, generator=g)
    skip = torch.tensor([3, 17, 5002, int(up.argmax())], dtype=torch.int32).unique()
    rest = torch.ones(5003, dtype=torch.bool)
    rest[skip.long()] = False
    for t in (1.0, 0.7):
        m, xt = float((up / t).max()), float((up / t).kthvalue(4990).values)
        a, n, z = nucleus_tail(lo, up, t, xt, m, 20.0, skip)
        xu, xl = (up / t)[rest].double(), (lo / t)[rest].double()
        ta, tz = float((xu[xu > xt] - m).exp().sum()), float((xl[xl >= m - 20] - m).exp().sum())
        assert n == int((xu > xt).sum()) and ta <= a <= ta * (1 + 2**-17) and tz * (1 - 2**-17) <= z <= tz
        assert nucleus_tail(lo, up, t, xt, m, 20.0, skip, want_z=False) == (a, n, 0.0)


def test_exp_bound_is_within_its_slack():
    y = torch.cat([torch.linspace(-79.9, 87.9, 2_000_003), -torch.rand(100_000) * 0.001, torch.tensor([0.0, -80.0, 88.0, 100.0])])
    e = exp_bound(y).double()
    ref = y.double().exp()
    mid = (y > -80) & (y < 88)
    assert float(((e[mid] - ref[mid]).abs() / ref[mid]).max()) < 2**-20
    assert float(e[-3]) == 0.0 and e[-2:].isinf().all()


def _force_screen(model) -> ScreenedHead:
    rt = model.runtime
    rt._screened = ScreenedHead.make(rt.head)
    return rt._screened


@pytest.mark.parametrize("arch", seeded_cases.ARCHS)
def test_seeded_outputs_are_the_stored_unscreened_texts(zoo, monkeypatch, arch):
    """Every strategy x sampling x prompt, solo and in generate_batch, with the screened pick (top-k
    screened too), gives the tokens stored from plain decoding before the screen existed."""
    stored = json.loads(seeded_cases.DATA.read_text())["tiny"]
    monkeypatch.setattr(sampled_head, "SCREEN_TRUNCATED", True)
    for dtype in seeded_cases.DTYPES:
        model = seeded_cases.tiny_model(zoo.get, arch, dtype)
        sh = _force_screen(model)
        try:
            got = seeded_cases.tiny_outputs(model)
        finally:
            model.runtime._screened = None  # the rest of the suite runs the model as shipped
        want = stored[f"{arch}|{dtype}"]
        assert got.keys() == want.keys()
        bad = [k for k in want if got[k] != want[k]]
        assert not bad, (dtype, bad[:5])
        assert sh.picks > 100 and sh.pick_full < sh.picks  # the screen decided the rows it could


@pytest.mark.slow
def test_default_model_seeded_outputs_are_the_stored_ones(default_model_bf16):
    stored = json.loads(seeded_cases.DATA.read_text())["default_bf16"]
    sh = screened_head(default_model_bf16.runtime)
    picks = sh.picks
    got = seeded_cases.default_outputs(default_model_bf16)
    assert got == stored
    assert sh.picks > picks
