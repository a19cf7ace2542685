"""Train an exit adapter for the default model (Gemma 3 270M, frozen) on the standard
library, then measure exit-adapter drafting against autoregressive decoding, and against
plain early exit at the same layer with the same draft vocabulary, side by side.

    python examples/train_gemma_adapter.py                        # 60 min of training, then the benchmark
    python examples/train_gemma_adapter.py --run OUT/run --out OUT2   # the benchmark alone, for a trained run
    python examples/train_gemma_adapter.py --minutes 1 --num-samples 1 --max-new-tokens 16 --eval-sequences 2   # smoke test

Steps (fixed seeds):
 1. load the benchmark prompts first (selfspec.tools.datasets: --datasets, --num-samples)
    and drop every training document that contains one of their lines
    (DataConfig.exclude_containing), so the adapter never sees the benchmark text;
 2. time the frozen model's teacher pass and an adapter step, and split --minutes between
    running the teacher over new text (--teacher-share of the time; that fixes
    --teacher-tokens) and further epochs over the cached teacher outputs (--max-steps);
 3. `selfspec train --recipe exit-adapter` (selfspec.training) into OUT/run: the model in
    float32, the adapter (an MLP, after attention with --adapter-heads) distilled toward the full model
    over the restricted draft vocabulary; the profile it writes drafts up to
    --num-speculations tokens while the draft's confidence stays above --draft-threshold;
 4. load the model again in bfloat16 and, on every prompt, run autoregressive, plain early
    exit (E, --fixed-k, draft vocabulary N), the adapter at --fixed-k, and the adapter as
    its profile says, back to back in rotating order; greedy; outputs compared token for
    token with autoregressive. Speedups count the whole generation, prefill included.

Writes OUT (default results/gemma_adapter-<time>; results/ is git-ignored): summary.json
(settings, the training run's held-out agreement numbers, per dataset and method:
tokens/s, speedup, acceptance, identical outputs) and the run directory (final/adapter.
safetensors + final/profile.json, usable with `selfspec generate --profile`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import selfspec  # noqa: E402
from selfspec.config import DraftConfig  # noqa: E402
from selfspec.profiles import atomic_write_text  # noqa: E402
from selfspec.tools.common import Settings, aggregate_runs, environment, measured_generate, run_record  # noqa: E402
from selfspec.tools.datasets import load_dataset  # noqa: E402
from selfspec.training.adapter_train import distill_kl, teacher_targets  # noqa: E402
from selfspec.training.config import AdapterConfig, DataConfig, LoopConfig, ModelConfig, TrainConfig  # noqa: E402
from selfspec.training.trainer import train  # noqa: E402

MODEL = "gemma-3-270m"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0, help="training budget, teacher passes included (default: 60)")
    p.add_argument("--exit-layer", type=int, default=12, help="E: the adapter reads the input of layer E (default: 12 of 18)")
    p.add_argument("--adapter-size", type=int, default=1024)
    p.add_argument("--adapter-heads", type=int, default=0, help="attention heads in the adapter, before its MLP (default: 0, the MLP alone)")
    p.add_argument("--adapter-head-dim", type=int, default=64)
    p.add_argument("--draft-vocab", type=int, default=16384)
    p.add_argument("--num-speculations", type=int, default=6, help="K written to the profile: the most drafts per step (default: 6)")
    p.add_argument("--draft-threshold", type=float, default=0.3,
                   help="written to the profile: drafting stops when the draft's confidence falls below it (default: 0.3; 0: always K)")
    p.add_argument("--fixed-k", type=int, default=3, help="K of the fixed-length comparisons: plain early exit, and the adapter without threshold (default: 3)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--teacher-share", type=float, default=0.7, help="share of the budget spent running the frozen model over new text (default: 0.7)")
    p.add_argument("--eval-sequences", type=int, default=32, help="held-out sequences for the agreement numbers")
    p.add_argument("--datasets", default="code,text", help="built-in prompt sets to benchmark on (default: code,text)")
    p.add_argument("--num-samples", type=int, default=5, help="prompts per set (default: 5)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default: 128, as selfspec bench)")
    p.add_argument("--run", default=None, help="benchmark this existing run directory (OUT/run of an earlier call) instead of training")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default: results/gemma_adapter-<time>)")
    return p.parse_args()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def exclusion_snippets(datasets) -> tuple[str, ...]:
    """The three longest lines (>= 30 characters, stripped) of every prompt and reference."""
    out: set[str] = set()
    for ds in datasets:
        for s in ds.samples:
            for text in (s.prompt, s.reference or ""):
                lines = sorted({ln.strip() for ln in text.splitlines() if len(ln.strip()) >= 30}, key=len, reverse=True)
                out.update(lines[:3])
    return tuple(sorted(out))


def time_teacher_and_step(args) -> tuple[float, float, float]:
    """(s per teacher pass over one sequence, s per adapter step of batch_size sequences,
    s for the one-off evaluation cache) on the fp32 model."""
    from selfspec.adapter import AdapterMeta, ExitAdapter, draft_logits

    m = selfspec.load(MODEL, dtype="float32")
    rt, E, T = m.runtime, args.exit_layer, args.seq_len
    head = rt.head_columns(m.draft_vocabulary(args.draft_vocab)).contiguous()
    ids = torch.randint(0, 20000, (T,), generator=torch.Generator().manual_seed(0))
    cache = rt.new_cache(T)
    times = []
    with torch.no_grad():
        for _ in range(3):  # as the trainer's teacher: both halves, the draft-vocabulary head, top-64 targets
            t = time.perf_counter()
            h_e = rt.run_layers(rt.embed(ids), 0, E, 0, cache)
            top_p, top_ids = teacher_targets(rt.logits(rt.run_layers(h_e, E, rt.num_layers, 0, cache), head=head), 1.0, 64)
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        rt.logits(rt.run_layers(h_e, E, rt.num_layers, 0, cache))  # the evaluation's full head
        full = time.perf_counter() - t
    adapter = ExitAdapter(AdapterMeta(E, m.spec.hidden_size, args.adapter_size, heads=args.adapter_heads, head_dim=args.adapter_head_dim))
    opt = torch.optim.AdamW(adapter.parameters(), lr=1e-9)
    h = h_e.expand(args.batch_size, -1, -1)  # [B, T, H]: whole sequences, as the trainer feeds them
    ids64, p64 = top_ids.repeat(args.batch_size, 1).long(), top_p.repeat(args.batch_size, 1)
    steps = []
    for _ in range(3):  # as the trainer's step: KL to the top-64 targets, backward, clipping, AdamW
        t = time.perf_counter()
        distill_kl(draft_logits(rt, adapter(h).flatten(0, 1), head), ids64, p64, 1.0).sum().backward()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        steps.append(time.perf_counter() - t)
    return sorted(times)[1], sorted(steps)[1], args.eval_sequences * (sorted(times)[1] + full)


def bench(model, methods: dict[str, DraftConfig], dataset, settings: Settings) -> dict:
    """Every method on every prompt, back to back, order rotating per prompt."""
    names = list(methods)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    identical = {n: 0 for n in names}
    prompts = sorted((s.prompt for s in dataset.samples), key=len, reverse=True)
    for cfg in methods.values():  # warm-up: one-time costs on the longest prompt
        measured_generate(model, prompts[0], cfg, settings, settings.seed)
    for i, sample in enumerate(dataset.samples):
        order = names[i % len(names):] + names[: i % len(names)]
        outs = {}
        for n in order:
            res = measured_generate(model, sample.prompt, methods[n], settings, settings.seed + i)
            outs[n] = res
            runs[n].append(run_record(res, sample))
        for n in names:
            identical[n] += outs[n].token_ids == outs["autoregressive"].token_ids
    agg = {n: aggregate_runs(runs[n]) for n in names}
    base = agg["autoregressive"]["tokens_per_second"]
    return {
        n: {"tokens_per_second": agg[n]["tokens_per_second"], "speedup": agg[n]["tokens_per_second"] / base,
            "acceptance_rate": agg[n]["acceptance_rate"], "mean_accepted_length": agg[n]["mean_accepted_length"],
            "identical_outputs": identical[n], "prompts": len(dataset.samples), "aggregate": agg[n]}
        for n in names
    }


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or ROOT / "results" / f"gemma_adapter-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and any(out.iterdir()):
        log(f"{out} is not empty; choose another --out")
        return 2

    # 1. benchmark prompts first: their text stays out of training
    datasets = [load_dataset(name, args.num_samples, args.seed) for name in args.datasets.split(",")]
    snippets = exclusion_snippets(datasets)
    if args.run:
        final = Path(args.run) / "final"
        if not (final / "profile.json").is_file():
            log(f"{final / 'profile.json'} not found: --run takes the run directory of an earlier call (OUT/run)")
            return 2
        training = json.loads((final / "training.json").read_text())
        return benchmark(args, out, final, datasets, training.get("eval") or {}, {"run": str(args.run), **training})

    # 2. split the budget
    t_teacher, t_step, t_eval = time_teacher_and_step(args)
    budget = args.minutes * 60 - t_eval
    sequences = max(args.batch_size, int(args.teacher_share * budget / t_teacher))
    first_epoch = sequences // args.batch_size
    steps = max(2, int(first_epoch + (budget - sequences * t_teacher - first_epoch * t_step) / t_step))
    log(f"teacher {t_teacher:.2f} s/sequence, adapter step {t_step:.2f} s, evaluation cache ~{t_eval:.0f} s -> "
        f"{sequences} sequences ({sequences * args.seq_len:,} tokens) through the teacher, {steps} steps")

    # 3. train
    cfg = TrainConfig(
        recipe="exit-adapter",
        out=str(out / "run"),
        data=DataConfig(data=("stdlib",), seq_len=args.seq_len, eval_sequences=args.eval_sequences, exclude_containing=snippets),
        model=ModelConfig(model=MODEL),
        adapter=AdapterConfig(exit_layer=args.exit_layer, adapter_size=args.adapter_size, adapter_heads=args.adapter_heads,
                              adapter_head_dim=args.adapter_head_dim, draft_vocab=args.draft_vocab,
                              num_speculations=args.num_speculations, teacher_tokens=sequences * args.seq_len),
        loop=LoopConfig(max_steps=steps, max_minutes=args.minutes, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                        eval_every=max(1, steps // 4), checkpoint_every=max(1, steps // 4), threads=args.threads),
    )
    result = train(cfg, log=log)
    training = {"steps": result.loop.step, "tokens": result.loop.tokens, "train_minutes": result.loop.train_seconds / 60,
                "stopped_by": result.loop.stopped_by, "held_out": result.summary["eval"], "data": result.summary["data"],
                "excluded_snippets": len(snippets), "profile": str(result.final / "profile.json")}
    return benchmark(args, out, result.final, datasets, result.summary["eval"], training)


def benchmark(args, out: Path, final: Path, datasets, ev: dict, training: dict) -> int:
    """4. every method on every prompt in bfloat16, greedy; summary.json and a table."""
    model = selfspec.load(MODEL, dtype="bfloat16")
    profile = str(final / "profile.json")
    adapter = model.draft_config(profile=profile)
    K, E, N = args.fixed_k, adapter.exit_layer, adapter.draft_vocab
    length = f"K<={adapter.num_speculations} threshold {adapter.draft_threshold:g}" if adapter.draft_threshold else f"K={adapter.num_speculations}"
    methods = {
        "autoregressive": DraftConfig("autoregressive"),
        f"early-exit E={E} K={K} vocab={N}": DraftConfig("early-exit", exit_layer=E, num_speculations=K, draft_vocab=N),
        f"exit-adapter E={E} K={K}": model.draft_config(profile=profile, num_speculations=K, draft_threshold=None),
        f"exit-adapter E={E} {length} (the profile)": adapter,
    }
    settings = Settings(max_new_tokens=args.max_new_tokens, seed=args.seed)
    measured = {}
    for ds in datasets:
        log(f"benchmarking on {ds.name} ({len(ds)} prompts) ...")
        measured[ds.name] = bench(model, methods, ds, settings)

    summary = {
        "settings": vars(args),
        "training": training,
        "benchmark": {name: {m: {k: v for k, v in r.items() if k != "aggregate"} for m, r in res.items()} for name, res in measured.items()},
        "benchmark_details": measured,
        "datasets": {ds.name: ds.info() for ds in datasets},
        "environment": environment(),
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")

    from rich.console import Console
    from rich.table import Table

    agreement = (f"; held-out agreement: adapter {ev['adapter_agreement']:.0%}, plain early exit {ev['early_exit_agreement']:.0%}"
                 if ev else "")
    tab = Table(title=f"exit adapter on {MODEL} (bfloat16), {args.max_new_tokens} new tokens per prompt{agreement}")
    for col in ("set", "method", "tok/s", "speedup", "acceptance", "tokens/verify", "identical"):
        tab.add_column(col)
    for name, res in measured.items():
        for m, r in res.items():
            tab.add_row(name, m, f"{r['tokens_per_second']:.1f}", f"x{r['speedup']:.2f}", f"{r['acceptance_rate']:.0%}",
                        f"{r['mean_accepted_length']:.2f}", f"{r['identical_outputs']}/{r['prompts']}")
    Console(stderr=True, width=160).print(tab)
    log(f"wrote {out}/summary.json")
    ok = all(r["identical_outputs"] == r["prompts"] for res in measured.values() for r in res.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
