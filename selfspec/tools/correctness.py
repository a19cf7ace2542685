"""`selfspec correctness`: greedy outputs of a strategy against autoregressive, token for token.

Self-speculative greedy decoding is meant to be lossless: every prompt must give exactly the
autoregressive token ids. Each prompt is generated with temperature 0 by both (ordinary
`generate` calls); a mismatch records the first differing position and the tokens around
it. The command exits with status 1 when any prompt differs.
"""

from __future__ import annotations

import os

from rich.table import Table

from selfspec.config import DraftConfig
from selfspec.tools.common import (
    FORMAT,
    ProgressBar,
    Settings,
    environment,
    measured_generate,
    model_info,
    now,
    strategy_label,
    write_json,
)
from selfspec.tools.datasets import Dataset


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(model, sample, base_res, strat_res) -> dict:
    a, b = list(base_res.token_ids), list(strat_res.token_ids)
    pos = first_difference(a, b)
    rec = {
        "id": sample.id,
        "source": sample.source,
        "identical": pos is None,
        "first_difference": pos,
        "baseline_tokens": len(a),
        "strategy_tokens": len(b),
        "baseline_finish": base_res.finish_reason,
        "strategy_finish": strat_res.finish_reason,
        "drafted": strat_res.stats.drafted,
        "accepted": strat_res.stats.accepted,
    }
    if pos is not None:
        lo, hi = max(0, pos - 3), pos + 4
        rec["baseline_around"] = a[lo:hi]
        rec["strategy_around"] = b[lo:hi]
        rec["around_start"] = lo
        tok = model.tokenizer
        if tok is not None:
            rec["baseline_text_around"] = tok.decode(a[lo:hi])
            rec["strategy_text_around"] = tok.decode(b[lo:hi])
        # was the first wrong token an accepted draft or the verifier's own token?
        rec["strategy_token_was_draft"] = bool(strat_res.drafted_mask[pos]) if pos < len(strat_res.drafted_mask) else None
    return rec


def run_correctness(
    model,
    draft: DraftConfig,
    dataset: Dataset,
    max_new_tokens: int,
    *,
    out: str | os.PathLike | None = None,
    progress: bool = True,
    command: list[str] | None = None,
) -> dict:
    model.drafter(draft)  # validate before generating
    settings = Settings(max_new_tokens=max_new_tokens, temperature=0.0, seed=0)
    results = {
        "format": FORMAT,
        "kind": "correctness",
        "created": now(),
        "command": command,
        "model": model_info(model),
        "strategy": draft.to_dict(),
        "strategy_label": strategy_label(draft),
        "settings": {**settings.to_dict(), "decoding": "greedy"},
        "dataset": dataset.info(),
        "environment": environment(),
        "requested": len(dataset.samples),
        "completed": 0,
        "interrupted": False,
        "mismatches": 0,
        "mismatch_ids": [],
        "first_difference": None,
        "samples": [],
    }

    def save():
        done = results["samples"]
        bad = [s for s in done if not s["identical"]]
        results["completed"] = len(done)
        results["mismatches"] = len(bad)
        results["mismatch_ids"] = [s["id"] for s in bad]
        results["first_difference"] = min((s["first_difference"] for s in bad), default=None)
        results["tokens_compared"] = sum(s["baseline_tokens"] for s in done)
        if out is not None:
            write_json(out, results)

    try:
        with ProgressBar(len(dataset.samples), "correctness", progress) as bar:
            for i, sample in enumerate(dataset.samples):
                base = measured_generate(model, sample.prompt, DraftConfig("autoregressive"), settings, 0)
                strat = measured_generate(model, sample.prompt, draft, settings, 0)
                results["samples"].append(compare(model, sample, base, strat))
                save()
                bad = results["mismatches"]
                bar.update(1, status=f"{bad} mismatch{'es' if bad != 1 else ''}" + (f" (first at token {results['first_difference']})" if bad else ""))
    except KeyboardInterrupt:
        results["interrupted"] = True
    save()
    return results


def correctness_table(results: dict):
    m = results["model"]
    t = Table(title=f"selfspec correctness: {results['strategy_label']} vs autoregressive (greedy) - {m['name']} ({m['dtype']}, {m['device']})"
                    + (" [interrupted]" if results.get("interrupted") else ""))
    for col in ("prompt", "tokens", "identical", "first difference", "autoregressive ids", "strategy ids"):
        t.add_column(col)
    for s in results["samples"]:
        if s["identical"]:
            t.add_row(s["id"], str(s["baseline_tokens"]), "[green]yes", "-", "", "")
        else:
            t.add_row(s["id"], f"{s['baseline_tokens']}/{s['strategy_tokens']}", "[bold red]NO", str(s["first_difference"]),
                      str(s.get("baseline_around")), str(s.get("strategy_around")))
    t.caption = f"{results['mismatches']} of {results['completed']} prompts differ ({results.get('tokens_compared', 0)} tokens compared)"
    return t
