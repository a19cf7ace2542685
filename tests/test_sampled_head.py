"""The Gumbel-max pick through the int8-screened head (selfspec/sampled_head.py): the token is the
unscreened pick's on adversarial rows (ties, near-ties at the screen's precision, all-equal
logits, one huge logit, top-k boundaries), a bound made too tight is caught, and seeded outputs
of every strategy, solo and batched, are the stored texts of plain, unscreened decoding
(tests/data/seeded_outputs.json, written by the code before the screen: seeded_cases.py).
Processed rows (processors.ProcessedRow: penalties, logit_bias, min_p, a grammar's mask; greedy
and sampled): the screened pick, where it decides, is the full processed row's on the same
adversarial rows, with a min_p boundary exactly on a token, penalties and a +100 bias that make a
token the screen would leave out the winner, a grammar allowing one token or only tokens far
outside the screen's candidates."""

from __future__ import annotations

import json
import math

import pytest
import torch

import seeded_cases
from selfspec import kernels, sampled_head
from selfspec.config import GenerationConfig, LogitBias, SamplingConfig
from selfspec.coupling import gumbel_noise, gumbel_token
from selfspec.greedy_head import PassCosts, ScreenedHead, screened_head
from selfspec.kernels.screen import act_residual, at_least, exp_bound, gumbel_reach, nucleus_tail, screen_bounds, screen_qgemm
from selfspec.processors import Processing, ProcessedRow, min_p_floor

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
        assert sh.picks == x.shape[0] and sh.pick_full <= x.shape[0] // 3 and sh.pick_computed < 1500 * x.shape[0] / 4, cfg


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_rows_left_to_the_full_head_are_the_full_rows(layout):
    """The first undecided row is computed alone, the rest together: each bit for bit its row of
    the whole pass (the head is row-invariant), one row computed first."""
    head, x = _adversarial(128, 1500, torch.bfloat16, layout)
    calls = []
    rows = sampled_head.HeadRows(x, ScreenedHead.make(head), lambda x: calls.append(x.shape[0]) or _full(x, head))
    whole = _full(x, head)
    for i in (4, 4, 1, 4, 5):
        assert torch.equal(rows[i].full(), whole[i]), i
    assert calls == [1, x.shape[0]] and rows.screen.pick_full == 3


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


def _force_screen(model, whole=None) -> ScreenedHead:
    """The screen on the model's head; every pass through it (whole None: no PassCosts choice),
    or through the full head where whole(rows, truncated) says so."""
    rt = model.runtime
    rt._screened = ScreenedHead.make(rt.head)
    rt._screened.costs.enabled = False
    if whole is not None:
        rt._screened.costs.whole = whole
    return rt._screened


def _count_processed(monkeypatch) -> dict:
    """Counts of processed rows (an edit) the screen decided, greedy and sampled."""
    seen = {"argmax": 0, "gumbel": 0}
    argmax, gumbel = sampled_head.HeadRow.argmax, sampled_head.HeadRow.gumbel

    def counted(name, fn):
        def f(self, *a, **kw):
            out = fn(self, *a, **kw)
            at = 3 if name == "gumbel" else 0  # gumbel(cfg, key, pos, edit), argmax(edit)
            edit = a[at] if len(a) > at else kw.get("edit")
            seen[name] += out is not None and edit is not None
            return out
        return f
    monkeypatch.setattr(sampled_head.HeadRow, "argmax", counted("argmax", argmax))
    monkeypatch.setattr(sampled_head.HeadRow, "gumbel", counted("gumbel", gumbel))
    return seen


@pytest.mark.parametrize("arch", seeded_cases.ARCHS)
def test_seeded_outputs_are_the_stored_unscreened_texts(zoo, monkeypatch, arch):
    """Every strategy x sampling x prompt, solo and in generate_batch, with the screened pick (top-k
    screened too; processed rows too: penalties, bias, min_p, greedy with processors), gives the
    tokens stored from plain decoding before the screen existed."""
    stored = json.loads(seeded_cases.DATA.read_text())["tiny"]
    monkeypatch.setattr(sampled_head, "SCREEN_TRUNCATED", True)
    processed = _count_processed(monkeypatch)
    checked = 0
    for dtype in seeded_cases.DTYPES:
        model = seeded_cases.tiny_model(zoo.get, arch, dtype)
        want = stored.get(seeded_cases.tiny_key(arch, dtype, model))
        if want is None:  # no texts stored for this machine's chain (python tests/seeded_cases.py tiny adds them)
            continue
        checked += 1
        sh = _force_screen(model)
        try:
            got = seeded_cases.tiny_outputs(model)
        finally:
            model.runtime._screened = None  # the rest of the suite runs the model as shipped
        assert got.keys() == want.keys()
        bad = [k for k in want if got[k] != want[k]]
        assert not bad, (dtype, bad[:5])
        assert sh.picks > 100 and sh.pick_full < sh.picks  # the screen decided the rows it could
    if not checked:
        pytest.skip("no stored texts for this machine's kernel chains")
    print("processed rows the screen decided:", processed)
    assert processed["argmax"] > 50 * checked / 2 and processed["gumbel"] > 200 * checked / 2, processed


def test_passes_through_the_full_head_are_the_stored_texts(zoo):
    """Verify passes whose seeded picks read the full head instead of the screen (PassCosts' choice,
    forced for every pass of 2 rows or more) give the stored tokens too, the screen's one-row passes
    beside them."""
    stored = json.loads(seeded_cases.DATA.read_text())["tiny"]
    arch, checked, passes = seeded_cases.ARCHS[0], 0, []
    for dtype in seeded_cases.DTYPES:
        model = seeded_cases.tiny_model(zoo.get, arch, dtype)
        want = stored.get(seeded_cases.tiny_key(arch, dtype, model))
        if want is None:
            continue
        checked += 1
        sh = _force_screen(model, whole=lambda rows, truncated: passes.append(rows) or rows >= 2)
        try:
            got = seeded_cases.tiny_outputs(model)
        finally:
            model.runtime._screened = None
        bad = [k for k in want if got[k] != want[k]]
        assert got.keys() == want.keys() and not bad, (dtype, bad[:5])
        assert sh.picks > 0  # one-row passes still went through the screen
    if not checked:
        pytest.skip("no stored texts for this machine's kernel chains")
    assert sum(r >= 2 for r in passes) > 20 and 1 in passes, passes[:40]


def test_pass_costs_choose_the_cheaper_side():
    """The screen first, the full head tried once at a row count, then whichever is cheaper by
    MARGIN, per kind of pick; one-row passes and a disabled choice always take the screen."""
    c = PassCosts()
    assert not c.whole(6, True)  # nothing seen: the screen
    c.saw_matmul(False, 6, 6e-3)
    c.saw_pick(False, True, 1.6e-3)
    assert c.whole(6, True)  # the full head never seen at 6 rows: tried
    c.saw_matmul(True, 6, 9e-3)
    c.saw_pick(True, True, 0.2e-3)
    assert c.whole(6, True)  # 9 + 1.2 ms against 6 + 9.6: cheaper
    assert not c.whole(1, True) and not c.whole(3, True)  # one row: the screen; 3 rows: its screen side unseen
    c.saw_pick(False, False, 0.7e-3)
    c.saw_pick(True, False, 0.4e-3)
    assert not c.whole(6, False)  # 9 + 2.4 against 6 + 4.2: the screen
    for _ in range(20):
        c.saw_matmul(True, 6, 16e-3)
    assert not c.whole(6, True)  # the full head got dearer: the averages follow
    c.enabled = False
    c.matmul_s[(True, 6)] = 0.0
    assert not c.whole(6, True)


_grammar_models: list = []


@pytest.mark.parametrize("few", [0, 512])
def test_grammar_outputs_are_the_stored_unscreened_texts(monkeypatch, few):
    """Under grammars (a regex, Lark, a JSON schema, a wide regex), greedy and seeded, every strategy
    the screen reads and generate_batch: the stored tokens of plain decoding. few: sampled_head.FEW
    (0: every row through the screen; 512: the allowed tokens' exact columns where they are few)."""
    stored = json.loads(seeded_cases.DATA.read_text())["grammar"]
    monkeypatch.setattr(sampled_head, "FEW", few)
    processed = _count_processed(monkeypatch)
    if not _grammar_models:
        _grammar_models.extend(seeded_cases.grammar_model())
    tok, model = _grammar_models
    sh = _force_screen(model)
    try:
        got = seeded_cases.grammar_outputs(tok, model)
    finally:
        model.runtime._screened = None
    assert got.keys() == stored.keys()
    bad = [k for k in stored if got[k] != stored[k]]
    assert not bad, bad[:5]
    print("processed rows the screen decided:", processed)
    assert processed["argmax"] > 50 and processed["gumbel"] > 100, processed


@pytest.mark.slow
def test_default_model_seeded_outputs_are_the_stored_ones(default_model_bf16):
    stored = json.loads(seeded_cases.DATA.read_text())["default_bf16"].get(default_model_bf16.runtime.numerics)
    if stored is None:
        pytest.skip(f"no stored texts for {default_model_bf16.runtime.numerics} (python tests/seeded_cases.py default adds them)")
    sh = screened_head(default_model_bf16.runtime)
    picks = sh.picks
    got = seeded_cases.default_outputs(default_model_bf16)
    assert got == stored
    assert sh.picks > picks


# ---- processed rows (processors.ProcessedRow through HeadRow.gumbel / argmax) ----------------


class _Mask:
    """A grammar matcher allowing a fixed set of tokens (what Processing asks of one)."""

    def __init__(self, allowed: torch.Tensor):
        self.mask = allowed

    def allowed(self, drafted=()):
        return self.mask

    def commit(self, tokens):
        pass


HISTORY = [1499, 1200, 333, 7, 650, 12, 1200]  # generated so far (1200 twice): low, tied and mid tokens
PROMPT = [5, 900, 1100]
DRAFTED = [1499, 41]


def _processing(cfg: SamplingConfig, v: int, allowed: torch.Tensor | None = None) -> Processing:
    proc = Processing(cfg, GenerationConfig(), PROMPT, v, matcher=None if allowed is None else _Mask(allowed))
    proc.commit(HISTORY)
    return proc


def _processed(head, x, cfg: SamplingConfig, allowed=None, drafted=DRAFTED, keys=range(8), pos0=50) -> tuple[list, list]:
    """Per row (and key): (the screened pick, None where it leaves the row to the full head; the
    full processed row's pick: its argmax when greedy). allowed: a mask, or a function of the full
    row (a per-row grammar)."""
    sh = ScreenedHead.make(head)
    rows = sampled_head.HeadRows(x, sh, lambda x: _full(x, head))
    full = _full(x, head)
    got, want = [], []
    for i in range(x.shape[0]):
        proc = _processing(cfg, full.shape[1], allowed(full[i]) if callable(allowed) else allowed)
        lazy = ProcessedRow(proc, rows[i], list(drafted))
        z = proc.row(full[i], list(drafted))
        if cfg.greedy:
            got.append(rows[i].argmax(lazy))
            want.append(int(z.argmax()))
            assert lazy.argmax() == want[-1]
            continue
        for key in keys:
            got.append(rows[i].gumbel(cfg, key, pos0 + i, lazy))
            want.append(gumbel_token(z, cfg, key, pos0 + i))
            assert gumbel_token(lazy, cfg, key, pos0 + i) == want[-1]
    return got, want


def _same_where_decided(got, want, least: float, what):
    assert all(g is None or g == w for g, w in zip(got, want)), (what, [(g, w) for g, w in zip(got, want) if g is not None and g != w][:4])
    assert sum(g is not None for g in got) >= least * len(got), (what, sum(g is not None for g in got), len(got))


def _bias(d: dict) -> LogitBias:
    return LogitBias.parse(d)


PROCESSED_CFGS = [
    SamplingConfig(temperature=1.0, min_p=0.1), SamplingConfig(temperature=0.8, min_p=0.05, top_p=0.9),
    SamplingConfig(temperature=0.7, min_p=0.3, top_k=5), SamplingConfig(temperature=0.05, min_p=0.5),
    SamplingConfig(temperature=3.0, min_p=0.9),
    SamplingConfig(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4),
    SamplingConfig(temperature=0.8, repetition_penalty=0.1),  # seen tokens' positive logits x10: one of them wins
    SamplingConfig(temperature=1.0, presence_penalty=-2.0, frequency_penalty=-2.0, top_p=0.95),  # generated ones lifted
    SamplingConfig(temperature=1.0, logit_bias=_bias({1499: 100.0})),  # a token the screen leaves out, forced
    SamplingConfig(temperature=0.8, top_p=0.9, logit_bias=_bias({7: -100.0, 3: -100.0, 333: 100.0, 1300: 6.0})),
    SamplingConfig(temperature=1.3, top_k=40, min_p=0.02, repetition_penalty=1.3, logit_bias=_bias({650: 3.0})),
    SamplingConfig(temperature=0.0, repetition_penalty=0.1), SamplingConfig(temperature=0.0, logit_bias=_bias({1499: 100.0})),
    SamplingConfig(temperature=0.0, presence_penalty=-2.0, frequency_penalty=-2.0, repetition_penalty=1.4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_processed_adversarial_rows_pick_the_exact_token(layout, dtype):
    if layout == "pairs" and dtype != torch.bfloat16:
        pytest.skip("the pair layout is bf16 only")
    head, x = _adversarial(128, 1500, dtype, layout)
    for cfg in PROCESSED_CFGS:
        got, want = _processed(head, x, cfg)
        _same_where_decided(got, want, 0.6, cfg)
        if cfg.logit_bias is not None and 1499 in dict(cfg.logit_bias.items) and cfg.logit_bias.items[-1][1] == 100.0:
            assert want.count(1499) >= len(want) // 2  # the bias does make it win (not over the 1e3-scaled column 500)


def _boundary_min_ps(xs: torch.Tensor, j: int) -> list[float]:
    """min_p values whose floor (processors.min_p_floor of xs's max) is exactly xs's j-th largest
    value, and one fp32 step either side of it (where they exist)."""
    s = xs.sort(descending=True).values
    xm, xj = s[0], s[j]
    targets = {float(xj), float(xj.nextafter(torch.tensor(float("inf")))), float(xj.nextafter(torch.tensor(-float("inf"))))}
    p0 = math.exp(float(xj) - float(xm))
    out = set()
    for k in range(-400, 401):
        p = p0 * (1 + k * 2.0**-28)
        if 0.0 < p < 1.0 and float(min_p_floor(xm, p)) in targets:
            out.add(p)
    return sorted(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_min_p_boundary_on_a_token(dtype):
    """min_p set so that the kept set ends exactly on a token (x_j == max x + ln min_p in fp32) and one
    fp32 step either side: the screen's bounds cannot tell, the exact values must."""
    head, x = _adversarial(128, 1500, dtype, "packed")
    full = _full(x, head)
    seen = 0
    for i in (0, 2, 3, 5):
        for t in (1.0, 0.8):
            for j in (1, 2, 5, 40):
                for p in _boundary_min_ps(full[i] / t, j):
                    seen += 1
                    for extra in ({}, dict(top_p=0.9), dict(top_k=3)):
                        cfg = SamplingConfig(temperature=t, min_p=p, **extra)
                        got, want = _processed(head, x[i : i + 1], cfg, drafted=(), keys=range(6), pos0=7 + i)
                        _same_where_decided(got, want, 0.0 if extra else 1.0, (i, t, j, p, extra))
    assert seen >= 20


@pytest.mark.parametrize("few", [0, 512, 2000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grammar_rows(monkeypatch, dtype, few):
    """A grammar's mask: one token allowed; only tokens far outside the screen's candidates (each
    row's 700 lowest logits); half the vocabulary. few: sampled_head.FEW (0: always through the
    screen; 2000: always exact columns of the allowed tokens)."""
    monkeypatch.setattr(sampled_head, "FEW", few)
    head, x = _adversarial(128, 1500, dtype, "packed")
    one = torch.zeros(1500, dtype=torch.bool)
    one[1234] = True
    half = torch.arange(1500) % 2 == 1
    masks = {"one": one, "low": lambda row: torch.zeros(1500, dtype=torch.bool).index_fill_(0, row.argsort()[:700], True),
             "half": half}
    for name, allowed in masks.items():
        for cfg in (SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_p=0.9),
                    SamplingConfig(temperature=0.9, top_k=20, min_p=0.05), SamplingConfig(temperature=0.7, min_p=0.2),
                    SamplingConfig(temperature=1.0, logit_bias=_bias({1234: 100.0, 2: 5.0}), presence_penalty=1.0),
                    SamplingConfig(temperature=0.0, logit_bias=_bias({1234: -100.0, 1: 100.0}))):
            got, want = _processed(head, x, cfg, allowed=allowed, keys=range(4))
            if name == "one":
                assert set(want) == {1234}
            # a flat row's whole-row pick often falls outside a top-k / top-p support: the full head decides those
            _same_where_decided(got, want, 0.9 if cfg.top_k is None and cfg.top_p is None else 0.3, (name, cfg))


@pytest.mark.parametrize("threads", [1, 2])
def test_gumbel_reach_is_its_definition(threads):
    """csrc/gumbel.c's reach pass (32 entries per block, four tokens a Philox counter) against its
    definition in torch: thr = max fl(fl(lo / T) + g), the set {fl(fl(up / T) + g) >= thr} in
    order with those upper scores; lengths off the block size, -inf entries, rows dense near the
    top and rows where a few tokens stand out."""
    g = torch.Generator().manual_seed(11)
    for n in (5003, 70001, 262144):
        for shape in ("dense", "peaked"):
            x = torch.randn(n, generator=g) * (1.0 if shape == "dense" else 4.0)
            if shape == "peaked":
                x[torch.randint(0, n, (20,), generator=g)] += 25.0
            w = torch.rand(n, generator=g) * 3
            lo, up = x - w, x + w
            lo[:: 97] = float("-inf")
            up[:: 97] = float("-inf")
            for t in (1.0, 0.7):
                for key, pos in ((3, 17), (2**63 + 5, 2**33 + 1)):
                    got = gumbel_reach(lo, up, t, key, pos, 4096, threads=threads)
                    noise = gumbel_noise(key, pos, torch.arange(n))
                    sl, su = (lo / t) + noise, (up / t) + noise
                    thr = float(sl.max())
                    want = (su >= thr).nonzero().flatten()
                    if len(want) > 4096:
                        assert got is None
                        continue
                    assert got is not None and got[0].tolist() == want.tolist() and torch.equal(got[1], su[want]), (n, shape, t)
                    assert got[2] == thr


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_at_least_and_the_bounds_max_are_their_definitions(threads):
    """kernels.at_least (one pass split among the pool's threads, shares merged in order) is
    (x >= thr).nonzero() with its cap, and screen_bounds' max lo is lo.max(), whatever the team:
    lengths off every split, ties at the threshold, -inf entries, a cap met exactly and passed."""
    g = torch.Generator().manual_seed(12)
    for n in (7, 70001, 262147):
        x = torch.randn(n, generator=g)
        x[:: 89] = float("-inf")
        x[5] = x[n // 2] = x[-1] = 1.5  # ties at the threshold, at both ends and across a split
        for thr in (1.5, 3.0, float("-inf")):
            want = (x >= thr).nonzero().flatten().to(torch.int32)
            for cap in (len(want), max(len(want) - 1, 0), 4096):
                got = at_least(x, thr, cap, threads=threads)
                if len(want) > cap:
                    assert got is None, (n, thr, cap)
                else:
                    assert got is not None and torch.equal(got, want), (n, thr, cap)
    sh = ScreenedHead.make(torch.randn(64, 70001, generator=g) / 8)
    x = torch.randn(1, 64, generator=g)
    a = screen_qgemm(x, sh.qhead)
    xn, dxn = act_residual(x, round_bf16=sh.pairs)
    one = screen_bounds(a[0], sh.ab, float(xn[0]), float(dxn[0]), False, threads=1)
    lo, up, lo_max = screen_bounds(a[0], sh.ab, float(xn[0]), float(dxn[0]), False, threads=threads)
    assert torch.equal(lo, one[0]) and torch.equal(up, one[1]) and lo_max == float(lo.max()) == one[2]
    assert bool((lo <= up).all())


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95])
def test_picks_outside_the_nucleus_are_decided_from_exact_columns(monkeypatch, top_p):
    """Where the unrestricted pick falls outside the top-p nucleus (about the share 1 - top_p of
    rows), the nucleus is proved from the exact columns of the tokens of largest upper bound and
    picked from: the exact head's token, without the full head for most such rows (and with
    NUCLEUS_COLUMNS empty, every such row went to the full head)."""
    g = torch.Generator().manual_seed(21)
    v, k = 4000, 128
    w = torch.randn(k, v, generator=g) / k**0.5
    w[:, :64] *= 4.0  # a language model's row: a few dozen plausible tokens far above a long tail
    x = torch.randn(8, k, generator=g) * 2.0
    head = kernels.pack(w.to(torch.bfloat16))
    x = x.to(torch.bfloat16)
    full = _full(x, head)
    cfg, plain = SamplingConfig(temperature=1.0, top_p=top_p), SamplingConfig(temperature=1.0)
    outside = []
    for i in range(x.shape[0]):
        keep = full[i].double().softmax(-1).sort(descending=True)
        kept = set(keep.indices[: int((keep.values.cumsum(0) < top_p).sum()) + 1].tolist())
        outside += [(i, key) for key in range(60) if gumbel_token(full[i], plain, key, 5 + i) not in kept]
    assert len(outside) >= 10
    for columns, most in ((sampled_head.NUCLEUS_COLUMNS, len(outside) // 4), ((), len(outside))):
        monkeypatch.setattr(sampled_head, "NUCLEUS_COLUMNS", columns)
        sh = ScreenedHead.make(head)
        rows = sampled_head.HeadRows(x, sh, lambda x: _full(x, head))
        undecided = 0
        for i, key in outside:
            assert gumbel_token(rows[i], cfg, key, 5 + i) == gumbel_token(full[i], cfg, key, 5 + i), (i, key, columns)
            undecided += rows[i].gumbel(cfg, key, 5 + i) is None
        assert undecided <= most and (columns or undecided >= len(outside) // 2), (columns, undecided, len(outside))
