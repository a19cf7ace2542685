"""Batched generation (selfspec.batch): every request's tokens equal its solo generation's,
whatever else is in the batch and whenever it joined; greedy and seeded sampling; every
strategy; cancellation, chunked prefill, the draft planner."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec import kernels
from selfspec.batch import BatchCosts, BatchEngine, BatchRequest
from selfspec.batch import planner
from selfspec.batch.engine import PREFILL_PATIENCE, default_prefill_chunk
from selfspec.batch.planner import DRAFT_ROWS, measure_draft, plan, plan_with_probes
from selfspec.config import DraftConfig, GenerationConfig, SamplingConfig
from selfspec.predictor import costs as costs_module
from helpers import ar_generate, build_hf, looping_model, prompts

N_NEW = 16
GREEDY = SamplingConfig()


def _ideal(dtype="float32", num_layers=4, dead_from=2, seed=1):
    """Layers >= dead_from add nothing: an early exit there is always right (drafts accepted)."""
    hf = build_hf("llama", seed=seed, num_layers=num_layers)
    with torch.no_grad():
        for layer in hf.model.layers[dead_from:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return selfspec.load(hf, dtype=dtype)


def _run(m, requests, late: dict[int, int] | None = None, **engine_kw) -> list:
    """Submit requests (request i after late[i] steps, default at once), step to the end."""
    late = late or {}
    eng = BatchEngine(m, **engine_kw)
    handles: dict[int, object] = {}
    steps = 0
    while len(handles) < len(requests) or not eng.idle():
        for i, r in enumerate(requests):
            if i not in handles and late.get(i, 0) <= steps:
                handles[i] = eng.submit(r)
        eng.step()
        steps += 1
    return [handles[i].result for i in range(len(requests))]


def _req(ids, draft="autoregressive", n=N_NEW, sampling=GREEDY, **kw):
    cfg = draft if isinstance(draft, DraftConfig) else DraftConfig(draft, **kw)
    return BatchRequest(list(ids), GenerationConfig(n), sampling, cfg)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gemma3"])
def test_greedy_equals_solo_alone_and_with_others(zoo, arch, dtype):
    _, m = zoo.get(arch, dtype=dtype)
    ps = prompts(n=8, seed=11, lengths=(7, 12, 3, 18, 5, 9, 14, 4))
    solo = [ar_generate(m, p, max_new_tokens=N_NEW).token_ids for p in ps]
    target = 0
    for others in (0, 1, 3, 7):
        reqs = [_req(p) for p in ps[: others + 1]]
        for late in ({}, {target: 5}, {i: 3 * i for i in range(1, others + 1)}):  # together / target late / others late
            got = _run(m, reqs, late, prefill_chunk=8)
            assert [r.token_ids for r in got] == solo[: others + 1], (others, late)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cfg", [
    DraftConfig("prompt-lookup", num_speculations=3),
    DraftConfig("early-exit", exit_layer=2, num_speculations=4),
    DraftConfig("early-exit", exit_layer=1, num_speculations=3, draft_threshold=0.3),
    DraftConfig("layer-skip", skip_mlp=(2, 3), num_speculations=3),
    DraftConfig("quantized", exit_layer=2, num_speculations=3),
    DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=2, num_speculations=4)),
    DraftConfig("early-exit", exit_layer=2, num_speculations=2, lookup_first=True),  # not batchable: runs solo steps
], ids=lambda c: c.label())
def test_speculative_batches_are_lossless(cfg, dtype):
    m = _ideal(dtype)
    ps = prompts(n=5, seed=2, lengths=(9, 4, 15, 6, 11))
    solo = [ar_generate(m, p, max_new_tokens=N_NEW).token_ids for p in ps]
    for planned in (False, True):
        got = _run(m, [_req(p, cfg) for p in ps], {3: 4, 4: 7}, plan_drafts=planned, prefill_chunk=6)
        assert [r.token_ids for r in got] == solo, planned
        if not planned and cfg.strategy != "auto":
            assert sum(r.stats.drafted for r in got) > 0
            assert sum(r.stats.accepted for r in got) > 0


@pytest.mark.parametrize("cfg", [
    DraftConfig("autoregressive"),
    DraftConfig("prompt-lookup", num_speculations=3),
    DraftConfig("early-exit", exit_layer=2, num_speculations=3),
    DraftConfig("quantized", num_speculations=2, draft_vocab=64),
    DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=2, num_speculations=4)),
    DraftConfig("auto", base=DraftConfig("prompt-lookup", num_speculations=2)),
], ids=lambda c: c.label())
def test_seeded_sampling_equals_solo(cfg):
    m = _ideal("bfloat16")
    m.set_token_frequencies(torch.arange(m.spec.vocab_size))
    ps = prompts(n=4, seed=5, lengths=(8, 13, 5, 10))
    samplings = [SamplingConfig(temperature=0.9, top_k=30, seed=1), SamplingConfig(temperature=1.1, seed=2),
                 SamplingConfig(temperature=0.7, top_p=0.9, seed=3), SamplingConfig(temperature=1.0, seed=4)]
    solo = [m.generate(p, max_new_tokens=N_NEW, draft=cfg, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                       seed=s.seed).token_ids for p, s in zip(ps, samplings)]
    for late in ({}, {0: 3, 2: 6}):
        got = _run(m, [_req(p, cfg, sampling=s) for p, s in zip(ps, samplings)], late, prefill_chunk=5)
        assert [r.token_ids for r in got] == solo, late


def test_mixed_strategies_and_samplings_in_one_batch(zoo):
    _, m = zoo.get("qwen3", dtype="bfloat16")
    ps = prompts(n=6, seed=9, lengths=(10, 6, 12, 8, 5, 9))
    cfgs = [DraftConfig("autoregressive"), DraftConfig("prompt-lookup"), DraftConfig("early-exit", exit_layer=1),
            DraftConfig("layer-skip", skip_attn=(1,)), DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=2)),
            DraftConfig("prompt-lookup", num_speculations=2)]
    samplings = [GREEDY, SamplingConfig(0.8, seed=3), GREEDY, SamplingConfig(1.0, top_k=10, seed=4), GREEDY,
                 SamplingConfig(0.9, top_p=0.8, seed=5)]
    solo = [m.generate(p, max_new_tokens=N_NEW, draft=c, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                       seed=s.seed).token_ids for p, c, s in zip(ps, cfgs, samplings)]
    got = _run(m, [_req(p, c, sampling=s) for p, c, s in zip(ps, cfgs, samplings)], {5: 4}, plan_drafts=False)
    assert [r.token_ids for r in got] == solo


@pytest.mark.skipif(not kernels.available(), reason="quantized drafting needs the kernels")
def test_a_greedy_sequence_alone_steps_as_generate_does(monkeypatch):
    """Decoding alone (no other rows this step), a greedy sequence takes generate's own step:
    its drafter's path (one-call draft passes, lookup guesses, copied tails), the same drafts
    and steps as generate. In company it is batched (the drafts of all run as one call)."""
    from selfspec.drafters import LayerSkipDrafter

    m = _ideal("float32")
    calls = []
    orig = LayerSkipDrafter.draft_guessed
    monkeypatch.setattr(LayerSkipDrafter, "draft_guessed", lambda self, *a, **kw: (calls.append(1), orig(self, *a, **kw))[1])
    ps = prompts(n=2, seed=2, lengths=(9, 9))
    cfg = DraftConfig("quantized", num_speculations=3)
    solo = [m.generate(p, max_new_tokens=N_NEW, draft=cfg) for p in ps]
    calls.clear()
    got = _run(m, [_req(ps[0], cfg)])[0]
    assert got.token_ids == solo[0].token_ids and calls
    assert (got.stats.verify_steps, got.stats.per_position_drafted) == (solo[0].stats.verify_steps, solo[0].stats.per_position_drafted)
    calls.clear()
    got = _run(m, [_req(p, cfg) for p in ps], plan_drafts=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in solo] and not calls
    sampled = SamplingConfig(temperature=0.9, seed=1)
    got = _run(m, [_req(ps[0], cfg, sampling=sampled)])[0]  # sampling keeps the batched path (and the solo tokens)
    assert not calls and got.token_ids == m.generate(ps[0], max_new_tokens=N_NEW, draft=cfg, temperature=0.9, seed=1).token_ids


@pytest.mark.skipif(not kernels.available(), reason="quantized drafting needs the kernels")
def test_a_hot_lookup_first_sequence_drafts_its_copy_in_a_batch(tmp_path, monkeypatch):
    """auto over a profile's quantized self-draft (lookup-first, greedy only) in a batch: a
    sequence whose last prompt-lookup copy held for all it committed (hot) drafts its next copy
    for free, past K up to the step's room, instead of its self-draft (a step then commits more
    than a self-draft could); output stays plain decoding's and the self-drafter hears of its
    own drafts only. The model has no attention output (zeroed o_proj): its next token depends
    on the last one only, so greedy text loops and copies hold."""
    from selfspec.batch.sequence import Sequence
    from selfspec.drafters import QuantizedDrafter
    from selfspec.profiles import Profile, install_profile

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    m = looping_model()
    K, N = 3, 40
    install_profile(Profile(DraftConfig("quantized", num_speculations=K), m.fingerprint, "loop"))
    ps = prompts(n=3, vocab=m.spec.vocab_size, lengths=(8, 12, 10), seed=11)
    ar = [ar_generate(m, p, max_new_tokens=N).token_ids for p in ps]
    rows = (1, 2, 4, 8, 16, 32, 64, 128)
    free = BatchCosts({r: 1.0 for r in rows}, {r: 0.1 for r in rows})  # rows cost nothing: the planner drafts
    steps, heard = [], []
    commit, accepted = Sequence.commit, QuantizedDrafter.accepted
    monkeypatch.setattr(Sequence, "commit", lambda self, n, nxt: (steps.append((self.copying, len(self.draft.tokens), n)),
                                                                   commit(self, n, nxt))[1])
    monkeypatch.setattr(QuantizedDrafter, "accepted", lambda self, step, d, n: (heard.append(len(d.tokens)),
                                                                                 accepted(self, step, d, n))[1])
    got = _run(m, [_req(p, "auto", n=N) for p in ps], costs=free)
    assert [r.token_ids for r in got] == ar
    assert all(r.stats.draft["source"] == "profile" for r in got)
    copied = [(d, n) for c, d, n in steps if c]
    assert copied and any(d > K and n > K for d, n in copied)  # hot copies, past K, accepted
    assert not steps[0][0] and any(not c and d for c, d, _ in steps)  # cold: the self-draft
    assert heard and max(heard) <= K


def test_auto_calibrating_on_its_own_prefill_runs_solo_steps(zoo):
    _, m = zoo.get("llama")
    ps = prompts(n=3, seed=4, lengths=(9, 12, 6))
    solo = [ar_generate(m, p, max_new_tokens=N_NEW).token_ids for p in ps]
    got = _run(m, [_req(p, DraftConfig("auto")) for p in ps], {2: 3})
    assert [r.token_ids for r in got] == solo


def test_cancel_frees_the_slot_and_the_queue_moves(zoo):
    _, m = zoo.get("llama")
    ps = prompts(n=3, seed=1, lengths=(5, 6, 7))
    eng = BatchEngine(m, max_batch=2)
    hs = [eng.submit(_req(p, n=40)) for p in ps]
    eng.step()
    assert eng.batch_size == 2 and eng.queue_depth == 1
    hs[0].cancel()  # no step running: retired at once
    assert hs[0].done and hs[0].result.finish_reason == "cancelled" and eng.batch_size == 1
    eng.run()
    assert hs[2].result.token_ids == ar_generate(m, ps[2], max_new_tokens=40).token_ids
    queued = eng.submit(_req(ps[0]))
    queued.cancel()
    assert queued.done and queued.result is None and eng.idle()


def test_chunked_prefill_keeps_running_streams_flowing(zoo):
    _, m = zoo.get("llama")
    short, long = prompts(n=2, seed=3, lengths=(4, 200))
    eng = BatchEngine(m, prefill_chunk=32)
    a = eng.submit(_req(short, n=30))
    eng.step()  # a's prefill
    b = eng.submit(_req(long, n=5))
    counts = []
    for _ in range(7):  # b's 200-token prompt takes 7 chunks; a gets a token every step meanwhile
        eng.step()
        counts.append(len(eng._active[0].out.ids))
    assert counts == list(range(2, 9))
    eng.run()
    assert a.result.token_ids == ar_generate(m, short, max_new_tokens=30).token_ids
    assert b.result.token_ids == ar_generate(m, long, max_new_tokens=5).token_ids
    assert a.result.stats.longest_stall_s > 0 and eng.longest_stall_s > 0  # reported (their size is the benchmark's business)


def test_prefill_takes_short_prompts_first_and_never_starves_a_long_one(zoo):
    """Prompts arriving together: the shortest are prefilled whole first (their first token a
    pass early); a long one is passed over at most PREFILL_PATIENCE steps, then goes first."""
    _, m = zoo.get("llama")
    long, s1, s2 = prompts(n=3, seed=5, lengths=(30, 6, 8))
    eng = BatchEngine(m, prefill_chunk=16)
    hs = [eng.submit(_req(p, n=12)) for p in (long, s1, s2)]
    eng.step()
    firsts = [len(s.out.ids) for s in eng._active]
    assert firsts == [0, 1, 1]  # 6 + 8 rows fit the chunk; the 30-row prompt (first in) waits
    steady = []
    for _ in range(PREFILL_PATIENCE + 3):  # newcomers keep arriving: a short prompt every step
        hs.append(eng.submit(_req(s1, n=2)))
        eng.step()
        steady.append(eng._active[0].prefilled)
    assert steady[PREFILL_PATIENCE - 2] == 0 and steady[PREFILL_PATIENCE - 1] > 0  # overdue: it goes first, cut to the chunk
    eng.run()
    assert hs[0].result.token_ids == ar_generate(m, long, max_new_tokens=12).token_ids
    assert hs[1].result.token_ids == ar_generate(m, s1, max_new_tokens=12).token_ids
    assert hs[2].result.token_ids == ar_generate(m, s2, max_new_tokens=12).token_ids
    assert all(h.result.token_ids == ar_generate(m, s1, max_new_tokens=2).token_ids for h in hs[3:])


def test_a_newcomers_short_prompt_gets_a_pass_of_its_own(zoo):
    """While others decode, newcomers' whole prompts of at most a chunk go first, alone (their
    first tokens do not wait for the running sequences' verification); never two such passes
    in a row; a longer prompt is chunked into the batched steps as before."""
    _, m = zoo.get("llama")
    running, newcomer, other, long = prompts(n=4, seed=4, lengths=(5, 8, 12, 40))
    eng = BatchEngine(m, prefill_chunk=16)
    a = eng.submit(_req(running, n=20))
    eng.step()  # a's prefill: its first token
    b = eng.submit(_req(newcomer, n=6))
    c = eng.submit(_req(other, n=6))
    eng.step()  # b's 8 rows alone (with c's 12 they would pass the chunk): b's first token, a waits
    assert [len(s.out.ids) for s in eng._active] == [1, 1, 0]
    eng.step()  # not a second prompt pass in a row: a batched step, with c's prompt in it
    assert [len(s.out.ids) for s in eng._active] == [2, 2, 1]
    d = eng.submit(_req(long, n=3))
    eng.step()  # 40 rows: chunked into the batched step (a, b and c decode)
    assert [len(s.out.ids) for s in eng._active] == [3, 3, 2, 0] and eng._active[3].prefilled == 16
    eng.run()
    assert a.result.token_ids == ar_generate(m, running, max_new_tokens=20).token_ids
    assert b.result.token_ids == ar_generate(m, newcomer, max_new_tokens=6).token_ids
    assert c.result.token_ids == ar_generate(m, other, max_new_tokens=6).token_ids
    assert d.result.token_ids == ar_generate(m, long, max_new_tokens=3).token_ids
    assert eng.longest_stall_s > 0
    # a pass of its own, then everyone leaves: the next batch starts afresh (no stale stall start)
    a = eng.submit(_req(running, n=20))
    eng.step()
    b = eng.submit(_req(newcomer, n=6))
    eng.step()
    assert eng._stall_from is not None
    a.cancel(), b.cancel()
    assert eng.idle()
    eng.submit(_req(running, n=4))
    eng.step()  # its prefill: nobody was decoding
    assert eng._stall_from is None
    eng.submit(_req(newcomer, n=4))
    eng.step()  # so this newcomer may have its own pass at once
    assert [len(s.out.ids) for s in eng._active] == [1, 1]


def test_a_newcomer_arriving_while_drafts_are_made_goes_before_the_verification(monkeypatch):
    """A request submitted while a step drafts gets its prompt's pass before that step's
    verification, and so its first token in that step; every output stays the solo one."""
    from selfspec.batch import engine as engine_module

    m = _ideal()
    running, newcomer = prompts(n=2, seed=6, lengths=(6, 7))
    cfg = DraftConfig("early-exit", exit_layer=2, num_speculations=3)
    eng = BatchEngine(m, prefill_chunk=16, plan_drafts=False)
    late = []
    drafting = engine_module.draft_depth

    def draft_depth(seqs):
        drafting(seqs)
        if seqs and seqs[0].draft.tokens and not late:
            late.append(eng.submit(_req(newcomer, cfg, n=5)))

    monkeypatch.setattr(engine_module, "draft_depth", draft_depth)
    a = eng.submit(_req(running, cfg, n=12))
    eng.step()  # a's prefill
    eng.step()  # a drafts; the newcomer arrives meanwhile and is prefilled before a's verification
    assert late and len(eng._active) == 2 and len(eng._active[1].out.ids) == 1 and len(eng._active[0].out.ids) > 1
    eng.run()
    assert a.result.token_ids == ar_generate(m, running, max_new_tokens=12).token_ids
    assert late[0].result.token_ids == ar_generate(m, newcomer, max_new_tokens=5).token_ids


@pytest.mark.parametrize("no_kernels", [False, True], ids=["kernels", "torch"])
def test_newcomers_arriving_during_a_pass_join_it(monkeypatch, no_kernels):
    """With an intake (the server's worker), requests that arrive while a pass runs join it at a
    stage boundary (passes.JOIN_STAGES): their first tokens come from that very pass, whether it
    verifies drafts (early exit's rows entering at the exit layer) or prefills; every output is
    the solo one, greedy and seeded sampling."""
    if no_kernels:
        monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    m = _ideal("float32")
    running, plain, sampled, third = prompts(n=4, seed=12, lengths=(6, 9, 7, 5))
    cfg = DraftConfig("early-exit", exit_layer=2, num_speculations=3)
    seeded = SamplingConfig(temperature=0.9, seed=7)
    # rows nearly free (a tiny model's measured tables are noise): newcomers arriving together share one pass
    flat = BatchCosts({r: 1.0 for r in planner.ROWS}, {r: 0.1 for r in planner.ROWS})
    eng = BatchEngine(m, prefill_chunk=32, plan_drafts=False, costs=flat)
    arriving: list[list[BatchRequest]] = [[_req(plain, n=8), _req(sampled, cfg, n=8, sampling=seeded)], [_req(third, n=6)]]
    joined, calls = [], []

    def intake():
        calls.append(len(eng._active))
        if len(calls) in (1, 4) and arriving:  # at the first boundary of a pass, and at another pass's
            joined.extend(eng.submit(r) for r in arriving.pop(0))

    a = eng.submit(_req(running, cfg, n=12))
    eng.intake = intake
    eng.step()  # a's prompt pass: two newcomers arrive during it and join it
    assert [len(s.out.ids) for s in eng._active] == [1, 1, 1]
    eng.step()  # a verifies its drafts; the third arrives during that pass and joins it
    assert len(eng._active) == 4 and len(eng._active[3].out.ids) == 1 and len(eng._active[0].out.ids) > 1
    eng.run()
    assert a.result.token_ids == ar_generate(m, running, max_new_tokens=12).token_ids
    assert joined[0].result.token_ids == ar_generate(m, plain, max_new_tokens=8).token_ids
    assert joined[1].result.token_ids == m.generate(sampled, max_new_tokens=8, draft=cfg, temperature=0.9, seed=7).token_ids
    assert joined[2].result.token_ids == ar_generate(m, third, max_new_tokens=6).token_ids


def test_default_prefill_chunk_scales_with_cores():
    assert default_prefill_chunk(1) == 32 and default_prefill_chunk(2) == 64 and default_prefill_chunk(64) == 512


class _S:
    def __init__(self, alpha):
        self.alpha = alpha


def test_planner_drafts_when_rows_are_free_and_not_when_they_cost():
    rows = (1, 2, 4, 8, 16, 32, 64, 128)
    free = BatchCosts({r: 1.0 for r in rows}, {r: 0.1 for r in rows})  # bandwidth-bound: rows cost nothing
    dear = BatchCosts({r: 0.2 * r for r in rows}, {r: 0.05 * r for r in rows})  # compute-bound
    seqs, caps = [_S(0.7), _S(0.2), _S(0.9)], [4, 4, 0]
    assert plan(free, seqs, caps, [None] * 3, 0, 0) == [4, 4, 0]
    assert plan(dear, seqs, caps, [None] * 3, 0, 0) == [0, 0, 0]
    mid = BatchCosts({r: 1.0 + 0.05 * r for r in rows}, {r: 0.1 for r in rows})
    k = plan(mid, seqs, caps, [None] * 3, 0, 0)
    assert k[0] >= k[1] and k[2] == 0  # the better-accepted sequence drafts at least as much
    flat = BatchCosts({r: 1.0 for r in rows}, {r: 0.0 for r in rows})  # measured flat by noise, prefill riding along
    assert len(plan(flat, seqs, caps, [None] * 3, 6, 1)) == 3  # decode rows charged > 0: no division by zero
    # probes: worth it only where a surely accepted token would pay (not in a compute-bound step)
    low = [_S(0.01), _S(0.01), _S(0.01)]
    assert plan_with_probes(mid, low, caps, [None] * 3, 0, 0) == ([0, 0, 0], [True, True, False])
    assert plan_with_probes(dear, low, caps, [None] * 3, 0, 0) == ([0, 0, 0], [False, False, False])


def _passes_cost(costs, lengths, groups):
    """Summed time to first token of prompts served in consecutive passes of these sizes."""
    t, total, i = 0.0, 0.0, 0
    for g in groups:
        t += costs.verify(sum(lengths[i : i + g]), g)
        total, i = total + t * g, i + g
    return total


def _best_partition(costs, lengths, cap, later_cap):
    """Brute force: the least summed time to first token over every partition into passes."""
    def parts(i, first):
        if i == len(lengths):
            yield []
        for j in range(i + 1, len(lengths) + 1):
            if j > i + 1 and sum(lengths[i:j]) > (cap if first else later_cap):
                break
            for rest in parts(j, False):
                yield [j - i, *rest]
    return min(_passes_cost(costs, lengths, p) for p in parts(0, True))


def test_prompt_group_minimises_the_summed_time_to_first_token():
    rows = (1, 2, 4, 8, 16, 32, 64, 128)
    free = BatchCosts({r: 1.0 for r in rows}, {r: 0.1 for r in rows})  # a pass costs the same whatever its rows
    dear = BatchCosts({r: 0.2 * r for r in rows}, {r: 0.0 for r in rows}, overhead=0.0)  # compute-bound: rows are everything
    assert planner.prompt_group(free, [5, 5, 5, 5], 20) == 4
    assert planner.prompt_group(free, [5, 5, 5, 5], 12) == 2  # the cap holds
    assert planner.prompt_group(free, [40, 5], 12) == 1  # a prompt alone may pass the cap (the engine cuts it)
    assert planner.prompt_group(dear, [5, 6, 7, 8], 64) == 1  # shortest first, one at a time
    assert planner.prompt_group(free, [], 64) == 0
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):  # the first pass of an optimal partition, against brute force
        fixed, per_row = torch.rand(2, generator=gen).tolist()
        c = BatchCosts({r: fixed + per_row * r / 16 for r in rows}, {r: 0.1 * fixed + 0.01 * r for r in rows})
        lengths = sorted(torch.randint(1, 30, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist())
        cap, later = int(torch.randint(20, 120, (1,), generator=gen)), int(torch.randint(10, 80, (1,), generator=gen))
        g = planner.prompt_group(c, lengths, cap, later)
        assert g == 1 or sum(lengths[:g]) <= cap
        rest = _best_partition(c, lengths[g:], later, later) if g < len(lengths) else 0.0
        t_first = c.verify(sum(lengths[:g]), g)
        assert t_first * len(lengths) + rest == pytest.approx(_best_partition(c, lengths, cap, later), rel=1e-9)


def test_prompts_arriving_together_share_the_pass_the_costs_pick(zoo):
    """Nothing decoding, four short prompts at once: with a pass's cost all fixed they all take
    the first pass (up to IDLE_GROUP_CHUNKS chunks: no stream stalls); with rows all the cost,
    the shortest goes alone. Every output is the solo one."""
    _, m = zoo.get("llama")
    ps = prompts(n=4, seed=8, lengths=(6, 7, 8, 9))
    rows = (1, 2, 4, 8, 16, 32, 64, 128)
    fixed = BatchCosts({r: 1.0 for r in rows}, {r: 0.1 for r in rows})
    per_row = BatchCosts({r: 0.2 * r for r in rows}, {r: 0.0 for r in rows}, overhead=0.0)
    for costs, firsts in ((fixed, [1, 1, 1, 1]), (per_row, [1, 0, 0, 0])):
        eng = BatchEngine(m, prefill_chunk=16, costs=costs)  # 30 rows: two chunks
        hs = [eng.submit(_req(p, n=6)) for p in ps]
        eng.step()
        assert [len(s.out.ids) for s in eng._active] == firsts
        eng.run()
        assert [h.result.token_ids for h in hs] == [ar_generate(m, p, max_new_tokens=6).token_ids for p in ps]


def test_planner_prices_self_drafts_by_their_measured_forward(monkeypatch):
    """A self-draft's tokens cost its timed batched draft forward (per signature, measured
    once), not a bytes-scaled guess: the same acceptance drafts when the forward is cheap and
    not when it costs as much as the verification it would save."""
    rows = (1, 2, 4, 8, 16, 32, 64, 128)
    timed: list = []

    def fake(draft_rt, exit_layer, head, skip_attn, skip_mlp):
        timed.append(draft_rt)
        per_row = {"cheap": 0.001, "dear": 0.5}[draft_rt]
        return {r: per_row * r for r in DRAFT_ROWS}

    monkeypatch.setattr(planner, "measure_draft", fake)
    costs = BatchCosts({r: 1.0 for r in rows}, {r: 0.1 for r in rows})
    seqs, caps = [_S(0.9), _S(0.9)], [4, 4]
    cheap, dear = ("cheap", 8, None, frozenset(), frozenset()), ("dear", 8, None, frozenset(), frozenset())
    assert plan(costs, seqs, caps, [cheap, cheap], 0, 0) == [4, 4]
    assert plan(costs, seqs, caps, [dear, dear], 0, 0) == [0, 0]
    assert timed == ["cheap", "dear"]  # once per signature
    assert costs.draft_step(cheap, 3) == pytest.approx(costs.overhead + 0.003)


def test_planner_grants_a_shared_draft_forward_to_the_whole_group(monkeypatch):
    """A draft forward costs about the same for 1 row as for 8: one sequence's token never pays
    for it, the group's eight do. The planner must see the joint move (granting one sequence
    at a time it would stay at zero), and a plan whose predicted gain is within MARGIN of
    decoding plainly is not taken."""
    rows = (1, 2, 4, 8, 16, 32, 64, 128)
    monkeypatch.setattr(planner, "measure_draft", lambda *a: {r: 1.0 for r in DRAFT_ROWS})
    costs = BatchCosts({r: 2.0 + 0.01 * r for r in rows}, {r: 0.0 for r in rows}, overhead=0.0)
    g = ("shared", 18, None, frozenset(), frozenset())
    k = plan(costs, [_S(0.9)] * 8, [4] * 8, [g] * 8, 0, 0)
    assert all(x >= 1 for x in k) and len(set(k)) == 1, k
    own = [("own", i, None, frozenset(), frozenset()) for i in range(8)]  # no forward shared
    assert plan(costs, [_S(0.9)] * 8, [4] * 8, own, 0, 0) == [0] * 8
    # one token each: 8 (1 + alpha) / (1.0 + 2.16) s against 8 / 2.08 plain, i.e. 1.03x at
    # alpha 0.55 (inside the margin: decode plainly) and 1.15x at 0.75
    assert plan(costs, [_S(0.55)] * 8, [4] * 8, [g] * 8, 0, 0) == [0] * 8
    assert plan(costs, [_S(0.75)] * 8, [4] * 8, [g] * 8, 0, 0) == [1] * 8
    assert planner.MARGIN > 1.0


def test_cost_scale_follows_measured_over_predicted():
    cs = planner.CostScale(weight=0.5)
    cs.observe((1.0, 2.0), (2.0, 2.0))
    assert cs.scales == pytest.approx((1.5, 1.0))
    cs.observe((0.0, 1.0), (5.0, 100.0))  # nothing predicted: no draft ratio; ratios clamped to 4
    assert cs.scales == pytest.approx((1.5, 2.5))
    fresh = planner.CostScale(weight=0.5)  # no draft timed yet: the draft table drifts as the verify pass
    fresh.observe((0.0, 1.0), (0.0, 2.0))
    assert fresh.scales == pytest.approx((1.5, 1.5))
    fresh.observe((1.0, 1.0), (1.0, 1.5))  # the first draft observation starts from there
    assert fresh.scales == pytest.approx((1.25, 1.5))


def test_measure_draft_times_the_draft_forward():
    m = _ideal("float32")
    rt = m.runtime
    q = m.resources.quantized(8)
    got = measure_draft(q, rt.num_layers, None, repeats=1)
    assert list(got) == list(DRAFT_ROWS) and all(t > 0 for t in got.values())
    assert all(got[b] >= got[a] for a, b in zip(DRAFT_ROWS, DRAFT_ROWS[1:]))


def test_draft_forwards_are_timed_against_the_layer_pass(monkeypatch):
    """The draft table is expressed in the layer table's time: each draft forward is timed
    alternately with the verifier's layer pass over the same rows and scaled by the table, so
    a machine that drifts between the two measurements does not tilt draft against verify."""
    m = _ideal("float32")
    rt = m.runtime
    costs = BatchCosts.measure(rt, repeats=1)
    sig = (m.resources.quantized(8), rt.num_layers, None, frozenset(), frozenset())
    clock = iter([3.0, 4.0] * 100)  # each draft forward 3 s, each layer pass 4 s, "now"
    monkeypatch.setattr(costs_module, "_seconds", lambda fn: (fn(), next(clock))[1])
    for r in (1, 8):
        assert costs.draft_step(sig, r) == pytest.approx(costs.overhead + 0.75 * costs.layers[r])
    free = BatchCosts(dict(costs.layers), dict(costs.head))  # tables given, no runtime to time against
    kwargs: list = []
    monkeypatch.setattr(planner, "measure_draft", lambda *a, **k: kwargs.append(k) or {r: 2.0 for r in DRAFT_ROWS})
    assert free.draft_step(sig, 1) == pytest.approx(free.overhead + 2.0) and kwargs == [{}]


def test_server_warmup_times_the_draft_forward_before_traffic(monkeypatch):
    """The planner times a self-draft's batched forward on first use (a few hundred ms on the
    default model): the server's warm-up does it, so no request waits for it."""
    from selfspec.server.worker import warmup

    m = _ideal("float32")
    draft = DraftConfig("quantized", num_speculations=3, draft_bits=8)
    warmup(m, draft)
    calls: list = []
    real = planner.measure_draft
    monkeypatch.setattr(planner, "measure_draft", lambda *a, **k: calls.append(a) or real(*a, **k))
    out = _run(m, [_req(p, draft) for p in prompts(n=3, seed=5, lengths=(6, 9, 4))])
    assert calls == [] and all(r.finish_reason == "length" for r in out)


def test_generate_batch_api(zoo):
    from helpers import word_tokenizer

    hf, _ = zoo.get("llama")
    m = selfspec.load(hf, dtype="float32", tokenizer=word_tokenizer())
    texts = ["the cat sat on the mat and the cat", "one two three four", "the red sun and the blue moon"]
    events: dict[int, list] = {}
    out = m.generate_batch(texts, max_new_tokens=12, strategy="prompt-lookup", temperature=0.8, seed=[1, 2, 3],
                           stop=["w5"], on_event=lambda i, e: events.setdefault(i, []).append(e))
    for i, t in enumerate(texts):
        solo = m.generate(t, max_new_tokens=12, strategy="prompt-lookup", temperature=0.8, seed=i + 1, stop=["w5"])
        assert (out[i].token_ids, out[i].text, out[i].finish_reason) == (solo.token_ids, solo.text, solo.finish_reason)
        assert [e.token_id for e in events[i]] == solo.token_ids
        assert "".join(e.text for e in events[i]) == solo.text


def test_torch_path_batches_exactly(monkeypatch):
    monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    m = _ideal("float32")
    assert not m.runtime.uses_kernels
    ps = prompts(n=3, seed=6, lengths=(5, 9, 7))
    solo = [ar_generate(m, p, max_new_tokens=N_NEW).token_ids for p in ps]
    cfg = DraftConfig("early-exit", exit_layer=2, num_speculations=3)
    got = _run(m, [_req(p, cfg) for p in ps], {2: 2}, plan_drafts=False)
    assert [r.token_ids for r in got] == solo


def test_a_freed_cache_serves_the_next_newcomer_and_its_stale_rows_never_count(monkeypatch):
    """A newcomer takes a freed cache of its capacity as is (the fused blocks never read a key
    past a query's own position); a runtime without them zeroes it first. Poisoned with NaN,
    the freed cache must change no token on either path."""
    ps = prompts(n=2, seed=8, lengths=(6, 11))
    for no_kernels in ("", "1"):
        monkeypatch.setenv("SELFSPEC_NO_KERNELS", no_kernels)
        m = _ideal("float32")
        assert (m.runtime.blocks is None) == bool(no_kernels)
        solo = [ar_generate(m, p, max_new_tokens=N_NEW).token_ids for p in ps]
        eng = BatchEngine(m, max_batch=1)
        h0 = eng.submit(_req(ps[0], DraftConfig("early-exit", exit_layer=2, num_speculations=3)))
        eng.run()
        assert h0.result.token_ids == solo[0]
        (freed,) = eng._caches._free
        freed.kt.fill_(float("nan"))
        freed.v.fill_(float("nan"))
        h1 = eng.submit(_req(ps[1], DraftConfig("early-exit", exit_layer=2, num_speculations=3)))
        eng.step()
        assert eng._active[0].cache is freed and not eng._caches._free
        eng.run()
        assert h1.result.token_ids == solo[1], f"no_kernels={no_kernels!r}"


def test_the_cache_pool_keeps_capacities_apart_and_its_bytes_bounded():
    from selfspec.cache import CachePool

    m = _ideal("float32")
    rt = m.runtime
    a, b = rt.new_cache(100), rt.new_cache(300)  # capacities 256 and 512
    size = a.kt.nbytes + a.v.nbytes
    pool = CachePool(rt, max_bytes=3 * size)
    pool.give(a)
    pool.give(b)  # 512 positions: twice a's bytes
    assert pool.take(200) is a and pool.take(100) is not a  # 256: a, then a new one
    assert pool.take(400) is b
    for c in [rt.new_cache(10) for _ in range(4)]:
        pool.give(c)
    assert len(pool._free) == 3 and pool.bytes == 3 * size  # the oldest dropped


def test_a_model_with_a_profile_has_its_batch_costs_from_load(tmp_path, monkeypatch):
    """Load prepares what the default strategy needs (model.prepare), the batch planner's pass
    costs too: the first generate_batch of a process does not measure them (it ran at 0.61x a
    warm call on the default model when it did). Kept on disk, so this happens once."""
    from selfspec.profiles import Profile, install_profile

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))  # installed profiles
    monkeypatch.setenv("SELFSPEC_COSTS_DIR", str(tmp_path / "costs"))
    kept = lambda: sum('"selfspec-batch-costs/' in f.read_text() for f in (tmp_path / "costs").glob("*.json"))  # noqa: E731
    hf = build_hf("llama", seed=4, num_layers=4)
    fp = selfspec.load(hf, dtype="float32").fingerprint
    assert kept() == 0  # no profile: measured at the first batch, if any
    install_profile(Profile(DraftConfig("early-exit", exit_layer=2, num_speculations=3), fp, "tiny"))
    m = selfspec.load(hf, dtype="float32")
    assert kept() == 1
    monkeypatch.setattr(BatchCosts, "measure", classmethod(lambda *a, **k: pytest.fail("measured at the first batch")))
    ps = prompts(n=2, seed=5, lengths=(6, 9))
    out = m.generate_batch(ps, max_new_tokens=6, strategy="autoregressive")
    assert [r.token_ids for r in out] == [ar_generate(m, p, max_new_tokens=6).token_ids for p in ps]


def test_batch_costs_are_measured_once_per_model_and_machine(tmp_path, monkeypatch):
    """The planner's pass costs and the draft tables it times are kept on disk beside the
    measured costs (same identity: model, numerics, threads, build): a new process (a new
    load of the same weights) reads them instead of paying for them in its first batch; a
    change of the thread count measures again."""
    from selfspec import kernels
    from selfspec.resources import DraftResources

    monkeypatch.setenv("SELFSPEC_COSTS_DIR", str(tmp_path / "costs"))
    hf = build_hf("llama", seed=3, num_layers=4)
    ps = prompts(n=3, seed=5, lengths=(6, 9, 4))
    m = selfspec.load(hf, dtype="float32")
    draft = DraftConfig("early-exit", exit_layer=2, num_speculations=3, draft_vocab=64)
    m.set_token_frequencies(torch.arange(m.spec.vocab_size))
    first = m.generate_batch(ps, max_new_tokens=8, draft=draft)
    costs = planner.kept_costs(m.resources)
    assert costs.drafts, "the batch timed its draft forward"
    (name,) = costs.drafts
    assert name.startswith("model E=2 head=64 ")
    assert sum('"selfspec-batch-costs/' in f.read_text() for f in (tmp_path / "costs").glob("*.json")) == 1

    monkeypatch.setattr(BatchCosts, "measure", classmethod(lambda *a, **k: pytest.fail("batch costs measured again")))
    monkeypatch.setattr(planner, "measure_draft", lambda *a, **k: pytest.fail("draft forward timed again"))
    m2 = selfspec.load(hf, dtype="float32")
    m2.set_token_frequencies(torch.arange(m2.spec.vocab_size))
    again = m2.generate_batch(ps, max_new_tokens=8, draft=draft)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert planner.kept_costs(m2.resources).to_dict() == costs.to_dict()

    monkeypatch.setattr(kernels, "threads", lambda: 97)  # another thread count: another identity
    with pytest.raises(pytest.fail.Exception, match="measured again"):
        planner.kept_costs(DraftResources(m2.runtime, m2.fingerprint))
