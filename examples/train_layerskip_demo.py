"""Does LayerSkip training make early exit pay? Train the same Llama from scratch twice on
the same text with the same wall-clock budget, with the LayerSkip recipe (layer dropout +
early-exit loss) and without it (plain next-token loss), then measure both side by side.

    python examples/train_layerskip_demo.py                     # 2 x 20 min + measuring, ~45 min
    python examples/train_layerskip_demo.py --minutes 1 --prompts 2 --max-new-tokens 16    # smoke test

Steps (fixed seeds throughout):
 1. read the `stdlib` corpus (selfspec/training/data.py), learn one BPE tokenizer
    (--vocab) on its training documents, tokenize and pack once for both runs;
 2. time a few steps of each recipe and set each run's --max-steps so that the run fills
    --minutes (the schedules need a horizon; --max-minutes stays as a hard cap);
 3. train `layerskip` and `lm` (selfspec.training.trainer) into OUT/layerskip and OUT/lm;
 4. per-layer top-1 agreement of every early exit with the last layer, and the held-out
    loss, on the same held-out sequences (from each run's final evaluation);
 5. load both results with selfspec.load(OUT/<run>/final) and, on prompts cut from
    held-out documents, run autoregressive decoding and early exit over a grid of exit
    layers x K, greedy, all configurations of both models interleaved per prompt; every
    output is checked against autoregressive decoding of the same model.

Writes OUT (default results/layerskip_demo-<time>; results/ is git-ignored):
    summary.json            everything below, plus settings and versions
    agreement.png           per-layer agreement curves of both runs
    speedup.png             speedup over autoregressive per (E, K), both runs
    layerskip/, lm/         the two training runs (checkpoints, final/, metrics.jsonl, loss_curve.png)
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
from selfspec.training import plots  # noqa: E402
from selfspec.training.config import DataConfig, LayerSkipConfig, LoopConfig, ModelConfig, TrainConfig  # noqa: E402
from selfspec.training.data import build_corpus, is_held_out, read_documents, sequence_order, train_bpe_tokenizer  # noqa: E402
from selfspec.training.distributed import Dist  # noqa: E402
from selfspec.training.layerskip import LayerSkipTask  # noqa: E402
from selfspec.training.models import new_model, preset_config  # noqa: E402
from selfspec.training.trainer import train  # noqa: E402

RUNS = ("layerskip", "lm")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="training budget of each run (default: 20)")
    p.add_argument("--preset", default="llama-12l", help="model shape (default: llama-12l: 12 layers, hidden 256)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size (default: 8192)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layer-dropout-max", type=float, default=0.2)
    p.add_argument("--early-exit-curriculum", default="rotational", choices=["none", "rotational", "gradual"])
    p.add_argument("--exit-loss-vocab", type=int, default=2048, help="non-final exit losses over the N most frequent targets")
    p.add_argument("--eval-sequences", type=int, default=32, help="held-out sequences for the agreement curves")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts for the speed measurement")
    p.add_argument("--prompt-chars", type=int, default=600)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--exit-layers", default=None, help="comma list (default: about L/6, L/4, L/3, L/2)")
    p.add_argument("--ks", default="2,4,6", help="K values (default: 2,4,6)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="generation dtype (default: selfspec's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output directory (default: results/layerskip_demo-<time>)")
    return p.parse_args()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


EVALS = 4  # evaluations during a run (plus one at the start): points of the loss curve


def run_config(args, out: Path, recipe: str, max_steps: int) -> TrainConfig:
    return TrainConfig(
        recipe=recipe,
        out=str(out / recipe),
        data=DataConfig(data=("stdlib",), seq_len=args.seq_len, eval_sequences=args.eval_sequences),
        model=ModelConfig(preset=args.preset, train_tokenizer=args.vocab),
        layerskip=LayerSkipConfig(layer_dropout_max=args.layer_dropout_max, early_exit_curriculum=args.early_exit_curriculum,
                                  exit_loss_vocab=args.exit_loss_vocab),
        loop=LoopConfig(max_steps=max_steps, max_minutes=args.minutes, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                        eval_every=max(1, max_steps // EVALS), checkpoint_every=max(1, max_steps // EVALS), threads=args.threads),
    )


def timings(cfg: TrainConfig, corpus, tokenizer, steps: int = 2) -> tuple[float, float]:
    """(seconds per optimizer step at mid-training (curricula half on), seconds per evaluation)."""
    cfg = cfg.resolved()
    model = new_model(preset_config(cfg.model.preset, tokenizer), cfg.loop.seed)
    task = LayerSkipTask(cfg, model, tokenizer, corpus, Dist())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    times = []
    B = cfg.loop.batch_size
    for i in range(steps + 1):
        step = cfg.loop.max_steps // 2 + i
        t = time.perf_counter()
        idx = sequence_order(corpus.train.num_sequences, 0, step * B, B)
        task.begin_step(step, idx)
        loss, _ = task.micro_loss(step, 0, idx, 0, B)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    task.evaluate(B)
    return min(times[1:]), time.perf_counter() - t


def held_out_prompts(docs, n: int, chars: int, eval_fraction: float) -> list[str]:
    """Beginnings of held-out Python modules (cut at a line end), deterministic."""
    out = []
    for d in sorted((d for d in docs if is_held_out(d.id, eval_fraction) and d.id.endswith(".py")), key=lambda d: d.id):
        text = d.all_text()
        if len(text) < 2 * chars:
            continue
        cut = text.rfind("\n", 0, chars)
        out.append(text[: cut + 1 if cut > 0 else chars])
        if len(out) == n:
            break
    return out


def measure(models: dict, prompts: list[str], grid: list[tuple[int, int]], max_new: int) -> dict:
    """All configurations of all models per prompt, interleaved; totals per configuration."""
    ar = DraftConfig("autoregressive")
    tot: dict = {name: {"AR": [0, 0.0]} | {f"E{e}K{k}": [0, 0.0, 0, 0] for e, k in grid} for name in models}
    identical = {name: True for name in models}
    for name, m in models.items():  # warm-up (one-time costs)
        m.generate(prompts[0], max_new_tokens=8, draft=ar)
        m.generate(prompts[0], max_new_tokens=8, draft=DraftConfig("early-exit", exit_layer=grid[0][0], num_speculations=grid[0][1]))
    for i, prompt in enumerate(prompts):
        for name, m in models.items():
            base = m.generate(prompt, max_new_tokens=max_new, draft=ar)
            tot[name]["AR"][0] += base.stats.new_tokens
            tot[name]["AR"][1] += base.stats.time_s
            for e, k in grid:
                r = m.generate(prompt, max_new_tokens=max_new, draft=DraftConfig("early-exit", exit_layer=e, num_speculations=k))
                t = tot[name][f"E{e}K{k}"]
                t[0] += r.stats.new_tokens
                t[1] += r.stats.time_s
                t[2] += r.stats.drafted
                t[3] += r.stats.accepted
                identical[name] &= r.token_ids == base.token_ids
        log(f"  prompt {i + 1}/{len(prompts)} measured")
    res = {}
    for name in models:
        ar_tps = tot[name]["AR"][0] / tot[name]["AR"][1]
        cells = []
        for e, k in grid:
            n, s, dr, ac = tot[name][f"E{e}K{k}"]
            cells.append({"exit_layer": e, "num_speculations": k, "tokens_per_second": n / s, "speedup": (n / s) / ar_tps,
                          "acceptance_rate": ac / dr if dr else 0.0})
        best = max(cells, key=lambda c: c["speedup"])
        res[name] = {"autoregressive_tokens_per_second": ar_tps, "cells": cells, "best": best, "identical_outputs": identical[name]}
    return res


def speedup_plot(speed: dict, grid, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels = [f"E{e} K{k}" for e, k in grid]
    width = 0.4
    for j, name in enumerate(speed):
        ax.bar([i + (j - 0.5) * width for i in range(len(grid))], [c["speedup"] for c in speed[name]["cells"]], width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(grid)), labels, rotation=45, fontsize=8)
    ax.set_ylabel("speedup over autoregressive (same model)")
    ax.set_title("early exit, greedy, held-out prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or ROOT / "results" / f"layerskip_demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and any(out.iterdir()):
        log(f"{out} is not empty; choose another --out")
        return 2
    out.mkdir(parents=True, exist_ok=True)

    # 1. data and tokenizer, once for both runs
    t = time.perf_counter()
    data_cfg = run_config(args, out, "lm", 1).data
    docs = read_documents(data_cfg)
    tokenizer = train_bpe_tokenizer([d for d in docs if not is_held_out(d.id, data_cfg.eval_fraction)], args.vocab)
    corpus = build_corpus(docs, tokenizer, data_cfg)
    log(f"data: {corpus.describe()}; tokenizer {len(tokenizer)} tokens ({time.perf_counter() - t:.0f} s)")

    # 2. steps that fill the budget, per recipe
    steps = {}
    for recipe in RUNS:
        s, ev = timings(run_config(args, out, recipe, 1000), corpus, tokenizer)
        steps[recipe] = max(2, int((args.minutes * 60 - (EVALS + 1) * ev) / s * 0.95))
        log(f"{recipe}: {s:.2f} s/step ({args.batch_size * args.seq_len / s:,.0f} tok/s), {ev:.1f} s/evaluation "
            f"-> {steps[recipe]} steps in {args.minutes:g} min")

    # 3. the two runs
    results = {}
    for recipe in RUNS:
        log(f"training {recipe} ...")
        r = train(run_config(args, out, recipe, steps[recipe]), log=log, corpus=corpus, tokenizer=tokenizer)
        results[recipe] = r

    # 4. agreement curves and held-out loss (each run's final evaluation: same held-out sequences)
    curves = {name: r.summary["eval"]["exit_agreement"] for name, r in results.items()}
    plots.agreement_curves({f"{n} (held-out loss {results[n].summary['eval']['eval_loss']:.3f})": c for n, c in curves.items()},
                           out / "agreement.png", f"{args.preset}, {args.minutes:g} min each, stdlib")

    # 5. speed, side by side
    models = {name: selfspec.load(str(r.final), dtype=args.dtype) for name, r in results.items()}
    L = models["lm"].spec.num_layers
    exits = [int(x) for x in args.exit_layers.split(",")] if args.exit_layers else sorted({max(1, L // 6), max(1, L // 4), max(1, L // 3), L // 2})
    grid = [(e, int(k)) for e in exits for k in args.ks.split(",")]
    prompts = held_out_prompts(docs, args.prompts, args.prompt_chars, data_cfg.eval_fraction)
    log(f"measuring {len(grid)} configurations x {len(prompts)} prompts x {len(models)} models ...")
    speed = measure(models, prompts, grid, args.max_new_tokens)
    speedup_plot(speed, grid, out / "speedup.png")

    summary = {
        "settings": vars(args),
        "data": corpus.describe(),
        "runs": {
            name: {
                "steps": r.loop.step,
                "tokens": r.loop.tokens,
                "train_minutes": r.loop.train_seconds / 60,
                "tokens_per_second": r.loop.tokens / max(r.loop.train_seconds, 1e-9),
                "held_out_loss": r.summary["eval"]["eval_loss"],
                "exit_agreement": r.summary["eval"]["exit_agreement"],
                "exit_loss": r.summary["eval"]["exit_loss"],
                "final": str(r.final),
                "speed": speed[name],
            }
            for name, r in results.items()
        },
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")

    from rich.console import Console
    from rich.table import Table

    tab = Table(title=f"LayerSkip vs plain LM: {args.preset}, {args.minutes:g} min each")
    for col in ("run", "steps", "held-out loss", "agreement E=L/4, L/2, 3L/4", "AR tok/s", "best early exit", "speedup", "acceptance", "identical"):
        tab.add_column(col)
    for name, r in summary["runs"].items():
        a = r["exit_agreement"]
        b = r["speed"]["best"]
        tab.add_row(name, str(r["steps"]), f"{r['held_out_loss']:.3f}", " / ".join(f"{a[max(0, q - 1)]:.0%}" for q in (L // 4, L // 2, 3 * L // 4)),
                    f"{r['speed']['autoregressive_tokens_per_second']:.1f}", f"E={b['exit_layer']} K={b['num_speculations']}",
                    f"x{b['speedup']:.2f}", f"{b['acceptance_rate']:.0%}", str(r["speed"]["identical_outputs"]))
    Console(stderr=True, width=160).print(tab)
    log(f"wrote {out}/summary.json, agreement.png, speedup.png")
    return 0 if all(summary["runs"][n]["speed"]["identical_outputs"] for n in RUNS) else 1


if __name__ == "__main__":
    sys.exit(main())
