"""The int8-screened exact greedy head (selfspec/greedy_head.py, csrc/screen.c): the bound it
rests on holds for every column, its argmax is the full head's (ties included), and greedy
generation does not change a token when it is used."""

from __future__ import annotations

import math

import pytest
import torch

from selfspec import greedy_head, kernels
from selfspec.greedy_head import ScreenedHead, screened_head
from selfspec.kernels.screen import act_residual, screen_qgemm, screen_quantize

from test_kernels import needs_kernels

pytestmark = needs_kernels

LAYOUTS = ["plain", "packed"] + (["pairs"] if kernels.has_pairs() else [])


def _head(k: int, v: int, dtype, layout: str, seed: int = 0, dup: bool = True):
    """A random [k, v] head in `layout`; with dup, column 7 repeats as columns 3 and 900 (exact
    ties: the first index must win), and a few columns are scaled up (outliers)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(k, v, generator=g) / k**0.5
    w[:, ::97] *= 4
    if dup:
        w[:, 3] = w[:, 7]
        if v > 900:
            w[:, 900] = w[:, 7]
    w = w.to(dtype)
    if layout == "plain":
        return w
    return kernels.pack(w, pairs=layout == "pairs")


def _rows(m: int, k: int, dtype, seed: int = 1, head=None):
    """Hidden states like a final norm's output: unit-ish entries, a few large dimensions; half
    the rows aligned with column 7 so that it (and its duplicates) wins."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, :4] *= 20
    if head is not None:
        w = head if isinstance(head, torch.Tensor) else head.unpack()
        x[::2] += 3 * w[:, 7].float() / w[:, 7].float().norm() * k**0.5
    return x.to(dtype)


def _full(x, head) -> torch.Tensor:
    return kernels.matmul(x, head).float()


def _screened_rows(sh: ScreenedHead, x, full) -> torch.Tensor:
    """What the screen decided, as rows [M, V]: each candidate's exact logit, -inf elsewhere,
    the full row where it could not decide (so the tests can check it value by value)."""
    cand, count, vals = sh.screen(x)
    out = torch.full((x.shape[0], sh.qhead.out_features), -math.inf)
    for m in range(x.shape[0]):
        c = int(count[m])
        if 0 < c <= greedy_head.CAP:
            out[m, cand[m, :c].long()] = vals[m, :c]
        else:
            out[m] = full(torch.tensor([m]))[0]
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bound_holds_for_every_column(layout, dtype):
    """|l - a| <= E for every (row, column): l the head's fp32 chain, a the int8 copy's value,
    E = ||x'|| alpha + ||x' - xhat|| beta; and alpha, beta are at least what float64 gives from
    the stored copy (the quantizer checked against a reference)."""
    if layout == "pairs" and dtype == torch.float32:
        pytest.skip("the pair layout is bf16 only")
    k, v = 200, 1000
    head = _head(k, v, dtype, layout)
    sh = ScreenedHead.make(head)
    x = _rows(24, k, torch.float32, head=head)
    l = kernels.matmul(x, head).double()  # fp32 x: fp32 logits (the pair layout rounds x to bf16 inside)
    a = screen_qgemm(x, sh.qhead).double()
    xn, dxn = act_residual(x, round_bf16=sh.pairs)
    E = xn[:, None] * sh.ab[0].double() + dxn[:, None] * sh.ab[1].double()
    assert ((l - a).abs() <= E).all()
    assert ((l - a).abs() / E).max() > 1e-3  # not vacuous: the error is a visible fraction of E
    # the coefficients from the stored copy, in float64
    w = (head if isinstance(head, torch.Tensor) else head.unpack()).double()
    q = sh.qhead.q.permute(1, 3, 0, 2).reshape(-1, sh.qhead.q.shape[0] * 64)[:k, :v].double() - 128
    what = q * sh.qhead.scale.double()
    assert (q.abs() <= 127).all() and torch.equal(q.abs().amax(0), torch.full((v,), 127.0, dtype=torch.float64))
    alpha_min = (w - what).norm(dim=0)
    beta_min = what.norm(dim=0)
    assert (sh.ab[0].double() >= alpha_min).all() and (sh.ab[1].double() >= beta_min).all()
    assert (sh.ab[0].double() <= alpha_min * 1.01 + 1e-3 * w.norm(dim=0)).all()  # and not much more


def test_a_shrunken_bound_is_caught():
    """The check above can fail: a tenth of E is exceeded somewhere."""
    head = _head(200, 1000, torch.float32, "packed")
    sh = ScreenedHead.make(head)
    x = _rows(24, 200, torch.float32, head=head)
    err = (kernels.matmul(x, head).double() - screen_qgemm(x, sh.qhead).double()).abs()
    xn, dxn = act_residual(x, round_bf16=False)
    E = xn[:, None] * sh.ab[0].double() + dxn[:, None] * sh.ab[1].double()
    assert (err > 0.1 * E).any()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_screened_argmax_is_the_full_heads(layout, dtype):
    """Argmax (first index on ties) of the screened rows equals the full head's; every finite
    entry is the full head's value bit for bit (bf16 inputs: bf16-rounded, as the head rounds)."""
    if layout == "pairs" and dtype == torch.float32:
        pytest.skip("the pair layout is bf16 only")
    k, v = 256, 1000
    head = _head(k, v, dtype, layout)
    sh = ScreenedHead.make(head)
    x = _rows(40, k, dtype, head=head)
    full = _full(x, head)
    out = _screened_rows(sh, x, lambda rows: _full(x[rows], head))
    assert sh.argmax(x, lambda rows: _full(x[rows], head)) == full.argmax(-1).tolist()
    assert torch.equal(out.argmax(-1), full.argmax(-1))
    fin = torch.isfinite(out)
    assert torch.equal(out[fin], full[fin])
    assert (fin.sum(-1) < v).all() and sh.full_rows == 0  # it screened: not every column is a candidate
    assert (full.argmax(-1)[::2] == 3).all()  # the duplicated column won where aligned: the tie went to index 3


def test_rows_the_screen_cannot_decide_take_the_full_head(monkeypatch):
    """A non-finite row, or one with more candidates than CAP, is the full head's row."""
    head = _head(128, 700, torch.float32, "packed")
    sh = ScreenedHead.make(head)
    x = _rows(6, 128, torch.float32, head=head)
    x[1, 5] = math.inf
    x[4, 0] = math.nan
    full = _full(x, head)
    asked = []
    got = sh.argmax(x, lambda rows: asked.append(rows.tolist()) or _full(x[rows], head))
    assert asked == [[1, 4]] and got == full.argmax(-1).tolist()
    assert sh.full_rows == 2
    monkeypatch.setattr(greedy_head, "CAP", 1)
    x = _rows(6, 128, torch.float32, seed=5)  # unaligned rows: several candidates each
    got = sh.argmax(x, lambda rows: _full(x[rows], head))
    full = _full(x, head)
    assert got == full.argmax(-1).tolist() and sh.full_rows > 2


def test_non_finite_weights_get_no_screen():
    w = torch.randn(64, 128)
    w[3, 9] = math.inf
    assert screen_quantize(kernels.pack(w), 1e-5, 1e-6) is None
    assert ScreenedHead.make(kernels.pack(w)) is None


def _force_screen(model) -> ScreenedHead:
    """The model's runtime with a screened head even when it is below MIN_WEIGHTS (tiny models)."""
    rt = model.runtime
    if getattr(rt, "_screened", None) is None:
        rt._screened = ScreenedHead.make(rt.head)
    return rt._screened


def _generate_both(model, prompt, **kw):
    """(tokens with the screened head, tokens with the full head) of one greedy request."""
    rt = model.runtime
    sh = _force_screen(model)
    try:
        screened = model.generate(prompt, **kw)
        rt._screened = None
        full = model.generate(prompt, **kw)
    finally:
        rt._screened = sh
    return screened, full


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_greedy_generation_is_unchanged_by_the_screen(zoo, arch):
    """Plain decoding and speculative strategies give the same tokens with the screened head
    as with the full head (tiny random models, fp32 and bf16)."""
    import helpers

    for dtype in ("float32", "bfloat16"):
        _, model = zoo.get(arch, dtype=dtype)
        for prompt in helpers.prompts(n=2):
            for strategy, opts in (("autoregressive", {}), ("early-exit", {"exit_layer": 2, "num_speculations": 3}),
                                   ("quantized", {"draft_bits": 8, "num_speculations": 3}), ("prompt-lookup", {})):
                a, b = _generate_both(model, prompt, max_new_tokens=24, strategy=strategy, **opts)
                assert a.token_ids == b.token_ids, (arch, dtype, strategy)
        assert model.runtime._screened.rows > 0
        model.runtime._screened = None  # the rest of the suite runs these models as shipped (no screen below MIN_WEIGHTS)


def test_batched_greedy_is_unchanged_by_the_screen(zoo):
    import helpers

    _, model = zoo.get("llama", dtype="bfloat16")
    prompts = helpers.prompts(n=3)
    solo = [model.generate(p, max_new_tokens=20, strategy="autoregressive").token_ids for p in prompts]
    rt = model.runtime
    sh = _force_screen(model)
    try:
        rt._screened = None
        unscreened = [r.token_ids for r in model.generate_batch(prompts, max_new_tokens=20, strategy="quantized", draft_bits=8)]
    finally:
        rt._screened = sh
    rows = sh.rows
    batched = [r.token_ids for r in model.generate_batch(prompts, max_new_tokens=20, strategy="quantized", draft_bits=8)]
    rt._screened = None
    assert batched == unscreened == solo
    assert sh.rows > rows  # the batch engine screened its greedy rows


def test_small_heads_are_not_screened(zoo):
    _, model = zoo.get("qwen2", dtype="bfloat16", seed=3)
    assert model.runtime.head.shape.numel() < greedy_head.MIN_WEIGHTS and screened_head(model.runtime) is None


@pytest.mark.slow
def test_default_model_screened_head(default_model_bf16):
    """On Gemma 3 270M (bf16): over real hidden states the screened argmax is the full head's,
    with few candidates a row; greedy generation is token-identical with and without it."""
    from selfspec.tools.builtin_sets import builtin_set

    m = default_model_bf16
    rt = m.runtime
    sh = screened_head(rt)
    assert sh is not None and sh.nbytes < 0.55 * rt.head.data.numel() * 2
    prompt = builtin_set("code", 1, 0, 0).samples[0].prompt
    a, b = _generate_both(m, prompt, max_new_tokens=48, strategy="autoregressive")
    assert a.token_ids == b.token_ids
    ids = torch.tensor(m.encode(prompt, False) + a.token_ids)
    with torch.inference_mode():
        h = rt.run_layers(rt.embed(ids), 0, rt.num_layers, 0, rt.new_cache(len(ids) + 4))
        x = kernels.norm_rows(h, rt.final_norm, rt.spec.rms_norm_eps)
        full = _full(x, rt.head)
        rows0, cands0, comp0 = sh.rows, sh.candidates, sh.computed
        got = sh.argmax(x, lambda rows: _full(x[rows], rt.head))
    assert got == full.argmax(-1).tolist()
    assert (sh.candidates - cands0) / (sh.rows - rows0) < 400
    assert sh.computed - comp0 < 0.5 * (sh.candidates - cands0)  # round 2 drops most candidates (~10 of ~40 a row)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_maximum_outside_the_first_round_is_found(layout, dtype):
    """Round 1 computes the SC_GROUP (8) candidates of largest int8 value; the answer may lie
    beyond them. Columns 0..9 have the same int8 value (their row-1 weight sets a coarse scale,
    and x reads row 0 only) but exact values 1.03 (decoys 0..8) and 1.04 (column 10 wins; its
    equal twin 11 loses the tie); round 1 takes 0..7 (first indices on ties), so only round 2
    can find 10, and must compute it although its int8 value is below the decoys' exact one.
    Column 12 (0.99, int8 value 1.0 too) is a candidate that cannot reach 1.03: not computed."""
    if layout == "pairs" and dtype != torch.bfloat16:
        pytest.skip("the pair layout is bf16 only")
    k, v = 64, 256
    g = torch.Generator().manual_seed(3)
    w = torch.randn(k, v, generator=g) * 0.01
    w[:, :12] = 0
    w[1, :12] = 12.7  # int8 scale 0.1 for these columns: 1.03 and 1.04 both quantize to 1.0
    w[0, :10] = 1.03
    w[0, 10:12] = 1.04
    w[:, 12] = 0
    w[1, 12], w[0, 12] = 12.7, 0.99
    w = w.to(dtype)
    head = w if layout == "plain" else kernels.pack(w, pairs=layout == "pairs")
    x = torch.zeros(3, k)
    x[:, 0] = 1.0
    x[1, 2:] = 1e-3  # small spread: the bound is no longer exact for the other columns
    x[2, 0] = -1.0  # the smallest of columns 0..11 everywhere else: any of the random columns
    x = x.to(dtype)
    full = _full(x, head)
    assert int(full[0].argmax()) == 10
    sh = ScreenedHead.make(head)
    asked = []
    assert sh.argmax(x[:1], lambda rows: asked.append(rows) or _full(x[rows], head)) == [10]
    assert sh.candidates == 13 and sh.computed == 12  # 0..12 screened; 8 in round 1, 4 in round 2
    assert sh.argmax(x, lambda rows: asked.append(rows) or _full(x[rows], head)) == full.argmax(-1).tolist()
    assert asked == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_tie_made_by_bf16_rounding_goes_to_the_first_index(layout):
    """bf16 inputs give bf16 logits: columns 3 and 7 differ by 0.126 in fp32 (far more than the
    bound, which is ~1e-3 here: weights and inputs almost exactly int8) but both round to 100,
    so the full head's argmax is 3. The screen must keep 3 although its fp32 bound alone
    excludes it."""
    k, v = 64, 128
    g = torch.Generator().manual_seed(0)
    w = torch.randn(k, v, generator=g) * 0.01
    w[:, 3] = 0
    w[:, 7] = 0
    w[0, 3] = w[0, 7] = 1.0
    w[32, 7] = 0.251953125  # 129 / 512: bf16, and within 1.5e-5 of 32 / 127 (its int8 value)
    head = w.bfloat16() if layout == "plain" else kernels.pack(w.bfloat16(), pairs=layout == "pairs")
    x = torch.zeros(2, k)
    x[:, 0], x[:, 32] = 100.0, 0.5
    x = x.bfloat16()
    full = _full(x, head)
    assert full[0, 3] == full[0, 7] == 100.0 and int(full[0].argmax()) == 3
    sh = ScreenedHead.make(head)
    assert sh.argmax(x, lambda rows: _full(x[rows], head)) == [3, 3]


def test_greedy_costs_use_the_argmax_only_head():
    from selfspec.predictor.costs import CostModel

    rows = (1, 2, 3, 5, 9, 17)
    full = CostModel(4, {r: 1.0 for r in rows}, {r: 1.0 for r in rows}, {r: 6.0 for r in rows})
    assert full.greedy() is full  # nothing measured for it: the same costs
    both = CostModel(4, {r: 1.0 for r in rows}, {r: 1.0 for r in rows}, {r: 6.0 for r in rows}, head_greedy={r: 3.0 for r in rows})
    assert both.greedy().ar_step == both.ar_step - 3.0 and both.greedy().verify(6) == both.verify(6) - 3.0
    assert CostModel.from_dict(both.to_dict()).head_greedy == both.head_greedy
