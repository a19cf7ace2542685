"""The compiled backend (selfspec/compiled, issue 53), proven on the CPU.

What is checked, and which equality each test proves:
- every verify bucket and every strategy traces as one graph (torch.compile fullgraph=True, the
  "eager" backend: Dynamo's trace, where a host read or a shape decided by a value would break
  the graph), greedy and sampled, batch buckets 1 and 8;
- no host read inside a step: .item() / .tolist() / bool(tensor) and friends raise while a step
  runs (on CUDA also torch.cuda.set_sync_debug_mode("error"));
- losslessness within the backend, bit for bit: every strategy's output equals the backend's own
  autoregressive output, greedy and Gumbel-max seeded, fp32 and bf16, batch 1 and 8 (a batch row
  equals its solo run), on tiny models with a drafter that is good but not perfect (layers past
  the exit scaled down: accepted and rejected drafts both occur);
- token equality with the existing runtime (its C kernels) in fp32, greedy and seeded: different
  kernels, so this holds where logits are close and nothing is a near-tie (it does on these);
- one real inductor compile (fp32, tiny llama): its steps give the uncompiled step's tokens.
The step runs uncompiled in the grid (the same tensor operations the compiled graph runs), so
that the suite does not pay an inductor compile per case on two busy cores.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import selfspec
from selfspec.compiled import CompiledModel
from selfspec.compiled.api import engine_of, plan_of
from selfspec.compiled.engine import CompiledEngine, capacity_for
from selfspec.compiled.step import BUCKETS, Plan, run_step
from selfspec.config import DraftConfig, GenerationConfig
from selfspec.errors import SelfSpecError

from helpers import build_hf

EXIT = 2
PROMPTS = [[1, 5, 9, 3, 7, 2, 11, 4], list(range(10, 40)), [3, 3, 8], list(range(60, 73)), [7], [2, 4, 6, 8, 10],
           list(range(30, 50, 2)), [9, 1, 9, 1, 9]]
STRATEGIES = [DraftConfig("early-exit", exit_layer=EXIT, num_speculations=3),
              DraftConfig("early-exit", exit_layer=1, num_speculations=7),
              DraftConfig("layer-skip", skip_attn=(2, 3), skip_mlp=(3,), num_speculations=4)]


def _good_drafter(arch: str, scale: float = 0.1):
    """A tiny model whose layers >= EXIT add little (their output projections scaled down): early
    exit at EXIT and skipping them draft well but not perfectly."""
    hf = build_hf(arch)
    with torch.no_grad():
        for layer in hf.model.layers[EXIT:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return hf


@pytest.fixture(scope="module")
def models():
    made = {}

    def get(arch: str, dtype: str) -> CompiledModel:
        if (arch, dtype) not in made:
            m = selfspec.load(_good_drafter(arch), dtype=dtype)
            engine_of(m).compile_backend = None  # the step's ops uncompiled (module doc)
            made[arch, dtype] = CompiledModel(m)
        return made[arch, dtype]
    return get


class _HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    """Tensor methods that read a value back to the host raise inside the block."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def f(*a, **k):
            raise _HostRead(f"host read inside a step: Tensor.{name}")
        return f
    for n in names:
        setattr(torch.Tensor, n, refuse(n))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        if cuda:
            torch.cuda.set_sync_debug_mode(0)


def _plans() -> list[Plan]:
    """Every strategy at every bucket: K = bucket - 1 (autoregressive: the 1-row bucket)."""
    plans = [Plan("autoregressive")]
    for w in BUCKETS[1:]:
        plans.append(Plan("early-exit", k=w - 1, exit_layer=1))
        plans.append(Plan("layer-skip", k=w - 1, skip_attn=frozenset({1}), skip_mlp=frozenset({0})))
    return plans


def _state(eng: CompiledEngine, batch: int, sampled: bool):
    cap = capacity_for(64)
    st = eng.new_state(batch, cap, [7] * batch if sampled else [None] * batch, 0.8)
    for b in range(batch):
        eng.prefill(st, b, [1, 2, 3, 4 + b], sampled)
    return st


def test_fullgraph_every_bucket_and_strategy():
    m = selfspec.load(build_hf("llama", num_layers=2), dtype="float32")
    eng = CompiledEngine(m.runtime, compile_backend="eager")
    torch._dynamo.reset()
    with torch.inference_mode():
        for plan in _plans():
            assert plan.width in BUCKETS
            for batch, sampled in ((1, False), (8, True)) if plan.k in (0, 3) else ((1, plan.k % 2 == 1),):
                st = _state(eng, batch, sampled)
                out = eng.step(plan, sampled, batch, st.cache.capacity)(st)  # fullgraph=True: a graph break raises
                assert out.shape == (batch, plan.k + 2)


def test_no_host_read_inside_a_step():
    m = selfspec.load(build_hf("gemma3"), dtype="float32")
    eng = CompiledEngine(m.runtime, compile_backend=None)
    with torch.inference_mode():
        for plan in (Plan("autoregressive"), Plan("early-exit", k=3, exit_layer=1), Plan("layer-skip", k=4, skip_mlp=frozenset({2}))):
            for sampled in (False, True):
                st = _state(eng, 2, sampled)
                w = eng.weights(st.cache.capacity)
                with no_host_reads():
                    out = run_step(w, plan, sampled, st)
                assert out.shape == (2, plan.k + 2)
        st = _state(eng, 1, False)
        with pytest.raises(_HostRead), no_host_reads():
            st.pos.sum().item()  # the instrument itself


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", [None, 11])
def test_lossless_every_strategy(models, arch, dtype, seed):
    m = models(arch, dtype)
    kw = dict(max_new_tokens=24, temperature=0.0 if seed is None else 0.9, seed=seed)
    accepted = rejected = 0
    for prompt in PROMPTS[:2]:
        ar = m.generate(prompt, draft=DraftConfig("autoregressive"), **kw)
        for cfg in STRATEGIES:
            r = m.generate(prompt, draft=cfg, **kw)
            assert r.token_ids == ar.token_ids, (cfg.label(), r.token_ids, ar.token_ids)
            accepted += r.stats.accepted
            rejected += r.stats.drafted - r.stats.accepted
        if dtype == "float32":  # the existing runtime, its own kernels: token equality (module doc)
            assert m.model.generate(prompt, strategy="autoregressive", **kw).token_ids == ar.token_ids
    assert accepted > 0 and rejected > 0  # both paths of the acceptance ran


@pytest.mark.parametrize("arch,dtype,seed", [("llama", "float32", None), ("gemma3", "bfloat16", 5), ("qwen3", "float32", 3)])
def test_batch_of_8_equals_solo(models, arch, dtype, seed):
    m = models(arch, dtype)
    kw = dict(max_new_tokens=20, temperature=0.0 if seed is None else 0.7, seed=seed)
    for cfg in (DraftConfig("autoregressive"), STRATEGIES[0]):
        batch = m.generate_batch(PROMPTS, draft=cfg, **kw)
        for p, r in zip(PROMPTS, batch):
            assert r.token_ids == m.generate(p, draft=cfg, **kw).token_ids
    if dtype == "float32":
        ref = m.model.generate_batch(PROMPTS, strategy="autoregressive", **kw)
        assert [r.token_ids for r in ref] == [r.token_ids for r in batch]


def test_stop_rules_and_refusals(models):
    m = models("llama", "float32")
    full = m.generate(PROMPTS[1], max_new_tokens=12, draft=STRATEGIES[0])
    eos = full.token_ids[5]
    cut = m.model.generate(PROMPTS[1], max_new_tokens=12, strategy="autoregressive", stop_token_ids=[eos])
    assert m.generate(PROMPTS[1], max_new_tokens=12, draft=STRATEGIES[0], stop_token_ids=[eos]).token_ids == cut.token_ids
    for cfg, words in ((DraftConfig("prompt-lookup"), "prompt lookup"), (DraftConfig("quantized"), "quantized"),
                       (DraftConfig("early-exit", exit_layer=2, draft_threshold=0.5), "draft_threshold")):
        with pytest.raises(SelfSpecError, match=words):
            plan_of(cfg)
    with pytest.raises(SelfSpecError, match="top_k"):
        m.generate(PROMPTS[0], max_new_tokens=4, temperature=0.5, top_k=5, draft=STRATEGIES[0])
    with pytest.raises(SelfSpecError, match="rejection"):
        m.generate(PROMPTS[0], max_new_tokens=4, temperature=0.5, coupling="rejection", draft=STRATEGIES[0])


def test_inductor_compiled_step_gives_the_same_tokens():
    """One real compile (inductor, the CPU's C++ kernels): early exit K=3 on a 2-layer llama."""
    m = selfspec.load(build_hf("llama", num_layers=2), dtype="float32")
    plain, compiled = CompiledEngine(m.runtime, compile_backend=None), CompiledEngine(m.runtime, compile_backend="inductor")
    gens = [GenerationConfig(max_new_tokens=16)] * 2
    plan = Plan("early-exit", k=3, exit_layer=1)
    ar = plain.generate(PROMPTS[:2], gens, Plan("autoregressive"), None, 0.0)
    out = compiled.generate(PROMPTS[:2], gens, plan, None, 0.0)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert [r.token_ids for r in out] == [r.token_ids for r in plain.generate(PROMPTS[:2], gens, plan, None, 0.0)]


def test_default_model(default_model):
    """Gemma 3 270M (fp32): every strategy equals the backend's autoregressive output and the
    existing runtime's, greedy; early exit seeded."""
    m = CompiledModel(default_model)
    engine_of(default_model).compile_backend = None
    prompt = "def fibonacci(n):"
    ar = m.generate(prompt, max_new_tokens=12, draft=DraftConfig("autoregressive"))
    assert ar.token_ids == default_model.generate(prompt, max_new_tokens=12, strategy="autoregressive").token_ids
    for cfg in (DraftConfig("early-exit", exit_layer=8, num_speculations=3), DraftConfig("layer-skip", skip_mlp=(3, 5, 7), num_speculations=3)):
        assert m.generate(prompt, max_new_tokens=12, draft=cfg).token_ids == ar.token_ids
    kw = dict(max_new_tokens=8, temperature=0.8, seed=3)
    sampled = m.generate(prompt, draft=DraftConfig("autoregressive"), **kw)
    assert m.generate(prompt, draft=DraftConfig("early-exit", exit_layer=8, num_speculations=3), **kw).token_ids == sampled.token_ids
    assert default_model.generate(prompt, strategy="autoregressive", **kw).token_ids == sampled.token_ids
