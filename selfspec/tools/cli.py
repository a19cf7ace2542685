"""The measurement commands: bench, sweep, correctness, report (picked up by selfspec.cli).

    selfspec bench --strategy early-exit --exit-layer 12 --dataset code --num-samples 20 --out bench.json
    selfspec sweep --exit-layers 4:16:2 --num-speculations 1:8 --dataset text --out-dir sweep/
    selfspec sweep --strategy layer-skip --skip-ratios 0.1:0.5:0.1 --num-speculations 2:6:2
    selfspec correctness --strategy prompt-lookup --dataset code --num-samples 50
    selfspec report bench.json other-machine.json sweep/sweep.json --out-dir report/

Results are written atomically after every prompt; Ctrl-C stops, writes what finished and
exits with status 130.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from selfspec.cli_args import (
    add_config_args,
    add_draft_args,
    add_model_args,
    check_before_loading,
    choice,
    config_kwargs,
    draft_config_from_args,
    load_model,
)
from selfspec.config import DRAFT_BITS, DraftConfig, SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec.loading import peek_shape
from selfspec.tools.bench import bench_table, run_bench
from selfspec.tools.common import Settings, strategy_label
from selfspec.tools.correctness import correctness_table, run_correctness
from selfspec.tools.datasets import load_dataset
from selfspec.tools.report import report
from selfspec.tools.sweep import SWEPT, parse_float_range, parse_int_range, run_sweep, sweep_table

INTERRUPTED = 130


def _add_dataset_args(p: argparse.ArgumentParser, default_samples: int) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset", default="code",
                   help="code | text | summarize (built in, offline), a .jsonl file with 'prompt' and optional 'reference', "
                        "or hf:NAME[:config]:split via the datasets library (default: code)")
    g.add_argument("--num-samples", type=int, default=default_samples, help=f"prompts to use (default: {default_samples})")
    g.add_argument("--n-shot", type=int, default=0, help="prepend N examples with their references (LayerSkip's n-shot)")
    g.add_argument("--template", default=None, help="wrap each prompt: a string containing {message}, e.g. '[INST] {message} [/INST]'")
    g.add_argument("--prompt-field", default="prompt", help="jsonl / hf: the prompt field (default: prompt)")
    g.add_argument("--reference-field", default=None, help="jsonl / hf: the reference field (default: reference)")


def _add_run_args(p: argparse.ArgumentParser, max_new_tokens: int, warmup: bool = True) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=f"tokens per prompt (default: {max_new_tokens})")
    if warmup:
        p.add_argument("--warmup", type=int, default=1, help="untimed generations of each configuration first (default: 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _dataset(args):
    return load_dataset(args.dataset, args.num_samples, args.seed if args.seed is not None else 0, n_shot=args.n_shot,
                        template=args.template, prompt_field=args.prompt_field, reference_field=args.reference_field)


def _check_common(args) -> None:
    if args.max_new_tokens < 1:
        raise SelfSpecError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if getattr(args, "warmup", 0) < 0:
        raise SelfSpecError(f"--warmup must be >= 0, got {args.warmup}")


def _settings(args):
    sampling = SamplingConfig(**config_kwargs(args, SamplingConfig))  # validates
    return Settings(args.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p,
                    sampling.seed if sampling.seed is not None else 0, sampling.coupling)


def console_width(is_terminal: bool, env: dict | None = None) -> int | None:
    """The width tables are fitted to: $COLUMNS when set (a terminal or not: CI logs, `| less`),
    else the terminal's own (None: rich asks it), else 160 (piped to a file: room for the wide
    tables)."""
    cols = (os.environ if env is None else env).get("COLUMNS", "").strip()
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    return None if is_terminal else 160


def _console():
    c = Console()
    width = console_width(c.is_terminal)
    return c if width is None or width == c.width else Console(width=width)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


def _loud(msg: str) -> None:
    """A warning that must not be missed: bold yellow on a terminal, plain text in a log."""
    Console(stderr=True, highlight=False).print(Text(msg, style="bold yellow"), soft_wrap=True)


# ---- bench ---------------------------------------------------------------------------------------


def cmd_bench(args) -> int:
    _check_common(args)
    settings = _settings(args)
    check_before_loading(args)
    dataset = _dataset(args)
    model = load_model(args)
    draft = draft_config_from_args(model, args)
    results = run_bench(model, draft, dataset, settings, warmup=args.warmup, out=args.out, progress=not args.no_progress,
                        command=sys.argv[1:], log=_err)
    _console().print(bench_table(results))
    if results["interrupted"]:
        _err(f"selfspec: interrupted; {results['completed']} of {results['requested']} prompts written to {args.out}")
        return INTERRUPTED
    _err(f"wrote {args.out}")
    return 0


# ---- sweep ---------------------------------------------------------------------------------------


def _check_exit_layers(rows: list[int], L: int) -> None:
    bad = [e for e in rows if not 1 <= e <= L - 1]
    if bad:
        raise SelfSpecError(f"--exit-layers: {bad} outside 1..{L - 1} for this {L}-layer model")


def cmd_sweep(args) -> int:
    _check_common(args)
    ks = parse_int_range(args.num_speculations, "--num-speculations")
    if args.strategy == "exit-adapter" and not args.adapter:
        raise SelfSpecError("--strategy exit-adapter needs --adapter FILE")
    if args.adapter and args.strategy != "exit-adapter":
        raise SelfSpecError("--adapter is for --strategy exit-adapter")
    if args.strategy != "quantized" and (args.draft_bits is not None or args.head_bits is not None):
        raise SelfSpecError("--draft-bits and --head-bits are for --strategy quantized")
    if args.strategy == "quantized":
        if args.exit_layers is not None or args.skip_ratios is not None:
            raise SelfSpecError("--strategy quantized sweeps --draft-bits (the whole depth), not --exit-layers or --skip-ratios")
        rows = parse_int_range(args.draft_bits or "4,8", "--draft-bits")
        if any(b not in DRAFT_BITS for b in rows) or (args.head_bits is not None and args.head_bits not in DRAFT_BITS):
            raise SelfSpecError(f"--draft-bits/--head-bits: bits must be among {', '.join(map(str, DRAFT_BITS))}")
        rows_text = None
    elif args.strategy in ("early-exit", "exit-adapter"):
        if args.skip_ratios is not None:
            raise SelfSpecError("--skip-ratios is for --strategy layer-skip")
        if args.strategy == "exit-adapter" and args.exit_layers is not None:
            raise SelfSpecError("--exit-layers: an exit adapter fixes its exit layer")
        rows_text = args.exit_layers
    else:
        if args.exit_layers is not None:
            raise SelfSpecError("--exit-layers is for --strategy early-exit")
        rows = parse_float_range(args.skip_ratios or "0.1:0.5:0.1", "--skip-ratios")
    settings = _settings(args)
    shape = peek_shape(args.model)
    if shape is not None and args.strategy == "early-exit" and rows_text is not None:
        _check_exit_layers(parse_int_range(rows_text, "--exit-layers"), shape[0])
    dataset = _dataset(args)
    model = load_model(args)
    if args.strategy == "exit-adapter":
        rows = [model.resources.adapter(args.adapter)[0].meta.exit_layer]
    elif args.strategy == "early-exit":
        L = model.spec.num_layers
        if rows_text is None:  # about six exit layers across the depth
            step = max(1, (L - 2) // 6)
            rows = list(range(max(1, step), L, step))[:8]
        else:
            rows = parse_int_range(rows_text, "--exit-layers")
        _check_exit_layers(rows, L)
    extra = {"draft_threshold": args.draft_threshold, "adaptive": args.adaptive or None, "draft_vocab": args.draft_vocab,
             "adapter": args.adapter, "head_bits": args.head_bits}
    results = run_sweep(model, args.strategy, rows, ks, dataset, settings, skip_kind=args.skip_kind, extra=extra,
                        warmup=args.warmup, out_dir=args.out_dir, profile_out=args.profile_out,
                        progress=not args.no_progress, command=sys.argv[1:], log=_err)
    console = _console()
    console.print(sweep_table(results, console.width))
    best = results.get("best")
    if best:
        _err(f"best: {strategy_label(best['draft'])}, speedup x{best['speedup']:.2f}, acceptance {best['acceptance_rate']:.0%}; "
             f"profile {results.get('profile')}")
        if best["speedup"] is not None and best["speedup"] < 1.0:
            _loud(f"WARNING: the best setting is SLOWER than autoregressive decoding (x{best['speedup']:.2f}): no setting of "
                  f"this sweep pays off. {results.get('profile') or 'The profile'} is marked as losing: --strategy auto and "
                  "install will not adopt it.")
    plots = [Path(p).name for p in results.get("plots", [])]
    _err(f"wrote {Path(args.out_dir) / 'sweep.json'}, sweep.csv" + "".join(f", {p}" for p in plots))
    if results["interrupted"]:
        _err("selfspec: interrupted; the finished measurements were written")
        return INTERRUPTED
    return 0


# ---- correctness ---------------------------------------------------------------------------------


def cmd_correctness(args) -> int:
    _check_common(args)
    check_before_loading(args)
    dataset = _dataset(args)
    model = load_model(args)
    draft = draft_config_from_args(model, args)
    if not draft.speculative:
        raise SelfSpecError("correctness compares a drafting strategy with autoregressive: pass --strategy or --profile")
    results = run_correctness(model, draft, dataset, args.max_new_tokens, out=args.out, progress=not args.no_progress,
                              command=sys.argv[1:])
    _console().print(correctness_table(results))
    n = results["mismatches"]
    line = f"{n} of {results['completed']} prompts differ"
    if n:
        line += f"; first differing position {results['first_difference']}; ids: {', '.join(results['mismatch_ids'])}"
    print(line)
    _err(f"wrote {args.out}")
    if results["interrupted"]:
        _err("selfspec: interrupted; the finished prompts were written")
        return INTERRUPTED
    return 1 if n else 0


# ---- report --------------------------------------------------------------------------------------


def cmd_report(args) -> int:
    labels = [s for s in args.labels.split(",")] if args.labels else None
    report(args.results, args.out_dir, labels, html_page=not args.no_html, console=_console())
    return 0


def register(sub) -> None:
    b = sub.add_parser("bench", help="a strategy vs autoregressive on a prompt set: speed, acceptance, quality",
                       description="Runs the strategy and the autoregressive baseline on the same prompts, interleaved, "
                                   "and writes per-prompt and aggregate numbers as JSON.")
    add_model_args(b)
    add_draft_args(b)
    _add_dataset_args(b, 10)
    _add_run_args(b, 128)
    add_config_args(b, SamplingConfig)
    b.add_argument("--out", default="bench-results.json", help="results JSON (default: bench-results.json)")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("sweep", help="grid of exit layers (or skip ratios) x K: CSV, JSON, heatmap, best profile",
                       description="Measures every (exit layer, K) or (skip ratio, K) cell against autoregressive.")
    add_model_args(s)
    s.add_argument("--strategy", type=choice(SWEPT, "sweep strategy"), default="early-exit",
                   help="early-exit, layer-skip, exit-adapter or quantized (default: early-exit)")
    s.add_argument("--adapter", default=None, help="exit-adapter: the trained adapter (its exit layer is the only row)")
    s.add_argument("--exit-layers", default=None, help="early-exit rows: start:stop[:step] (inclusive) or a list (default: ~6 across the depth)")
    s.add_argument("--skip-ratios", default=None, help="layer-skip rows: start:stop[:step] or a list of ratios in (0,1) (default: 0.1:0.5:0.1)")
    s.add_argument("--draft-bits", default=None, help="quantized rows: bits of the draft copy, a list of 4 and/or 8 (default: both)")
    s.add_argument("--head-bits", type=int, default=None, help="quantized, fixed for every cell: bits of the draft head (default: the row's bits)")
    s.add_argument("--skip-kind", type=choice(("attn", "mlp", "both"), "skip kind"), default="both", help="layer-skip: which sub-layers of a skipped layer to skip (default: both)")
    s.add_argument("--num-speculations", default="1:8", help="K values: start:stop[:step] (inclusive) or a list (default: 1:8)")
    s.add_argument("--draft-threshold", type=float, default=None, help="fixed for every cell: stop drafting below this top-1 probability")
    s.add_argument("--adaptive", action="store_true", help="fixed for every cell: adaptive draft threshold")
    s.add_argument("--draft-vocab", type=int, default=None, help="fixed for every cell: restricted draft vocabulary size")
    _add_dataset_args(s, 5)
    _add_run_args(s, 64)
    add_config_args(s, SamplingConfig)
    s.add_argument("--out-dir", default="sweep-results", help="where sweep.json/.csv and the plots go (default: sweep-results)")
    s.add_argument("--profile-out", default=None, help="the best cell's draft profile (default: OUT_DIR/best_profile.json)")
    s.set_defaults(func=cmd_sweep)

    c = sub.add_parser("correctness", help="greedy outputs of a strategy vs autoregressive, token for token (exit 1 on any difference)")
    add_model_args(c)
    add_draft_args(c)
    _add_dataset_args(c, 10)
    _add_run_args(c, 64, warmup=False)
    c.add_argument("--seed", type=int, default=None, help="prompt selection seed (default: 0)")
    c.add_argument("--out", default="correctness-results.json", help="results JSON (default: correctness-results.json)")
    c.set_defaults(func=cmd_correctness)

    r = sub.add_parser("report", help="tables, PNG plots and an HTML page from saved results files")
    r.add_argument("results", nargs="+", help="bench / sweep / correctness / compare_all JSON files")
    r.add_argument("--out-dir", default="report", help="where the plots and index.html go (default: report)")
    r.add_argument("--labels", default=None, help="comma-separated names for the files, in order")
    r.add_argument("--no-html", action="store_true", help="plots only, no index.html")
    r.set_defaults(func=cmd_report)
