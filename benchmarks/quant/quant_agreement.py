"""How often a low-bit copy of the default model's own weights agrees with the model itself.

For each prompt of the built-in code and text sets, the full model (bfloat16) writes its greedy
continuation; then, teacher-forced over it, each quantized copy predicts every next token:
  * shared KV: the copy attends to the *full model's* keys/values for earlier positions and
    writes only its own row (what a quantized draft in the engine sees);
  * own KV: the copy runs the whole sequence itself (a separate draft model's view).
Reports top-1 agreement per format and cache choice, the sampling acceptance E[sum min(p, q)]
at temperature 0.8 / top_p 0.95 (shared KV), the extra bytes, and the draft cost c (one draft
token / one autoregressive step, measured).

The copy's LM head is quantized like its layers (over the 16k most frequent tokens for int8-16k).

    .venv/bin/python benchmarks/quant/quant_agreement.py [--num-samples 3] [--max-new-tokens 64] [--formats int8,int4-g64,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import selfspec
from selfspec.config import SamplingConfig
from selfspec.predictor.costs import time_call
from selfspec.quant import quantize_columns
from selfspec.sampling import probs_from_logits
from selfspec.tools.datasets import load_dataset

FORMATS = {  # name -> (bits, head: "full" | "16k"); int4 in groups of 64 rows (quant.INT4_GROUP, the kernel's)
    "int8": (8, "full"),
    "int8-16k": (8, "16k"),
    "int4-g64": (4, "full"),
}
SAMPLING = SamplingConfig(temperature=0.8, top_p=0.95)


def agreement(m, draft_rt, head, vocab, ids: list[int], start: int) -> tuple[list[bool], list[bool], list[float]]:
    """Teacher-forced over ids (ids[:start] the prompt): per scored position, does the copy's
    greedy token equal the full model's (shared KV, own KV), and sum(min(p, q)) (shared KV)."""
    rt = m.runtime
    n = len(ids)
    shared, own, overlap = [], [], []
    with torch.inference_mode():
        cache = rt.new_cache(n + 8)
        target_logits = rt.forward(torch.tensor(ids), 0, cache)  # full model: every row, its KV in the cache
        own_logits = draft_rt.logits(draft_rt.run_layers(draft_rt.embed(torch.tensor(ids)), 0, rt.num_layers, 0,
                                                         draft_rt.new_cache(n + 8)), head=head)
        for p in range(start, n - 1):
            target = int(target_logits[p].argmax())
            h = draft_rt.run_layers(draft_rt.embed(torch.tensor([ids[p]])), 0, rt.num_layers, p, cache)
            q_logits = draft_rt.logits(h, head=head)[0]
            rt.forward(torch.tensor([ids[p]]), p, cache)  # the verifier's row back for the next position
            tok = int(q_logits.argmax()) if vocab is None else int(vocab[q_logits.argmax()])
            shared.append(tok == target)
            own_tok = int(own_logits[p].argmax()) if vocab is None else int(vocab[own_logits[p].argmax()])
            own.append(own_tok == target)
            p_full = probs_from_logits(target_logits[p], SAMPLING)
            q_sub = probs_from_logits(q_logits, SAMPLING)
            q = q_sub if vocab is None else torch.zeros_like(p_full).index_copy_(0, vocab, q_sub)
            overlap.append(float(torch.minimum(p_full, q).sum()))
    return shared, own, overlap


def step_time(fn, repeats: int = 20) -> float:
    return time_call(fn, repeats, statistics.median)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-samples", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    console = Console()
    m = selfspec.load("gemma-3-270m", dtype="bfloat16")
    rt = m.runtime
    samples = [s for name in ("code", "text") for s in load_dataset(name, args.num_samples).samples]
    seqs = []
    for s in samples:
        ids = m.encode(s.prompt)
        out = m.generate(ids, max_new_tokens=args.max_new_tokens, strategy="autoregressive")
        seqs.append((ids + out.token_ids, len(ids)))
    bf16_bytes = rt.weight_bytes()
    with torch.inference_mode():
        cache = rt.new_cache(256)
        one = torch.tensor([1])
        t_ar = step_time(lambda: rt.forward(one, 100, cache))
    table = Table(title=f"quantized copies of {m.name}: agreement with the full model (bf16), "
                        f"{len(seqs)} prompts x {args.max_new_tokens} tokens")
    for col in ("format", "greedy agreement, shared KV", "own KV", "sampling E[min(p,q)]", "extra MB (x bf16)", "c"):
        table.add_column(col)
    for name in args.formats.split(","):
        bits, which = FORMATS[name]
        vocab = m.draft_head(16384)[0] if which == "16k" else None
        t0 = time.perf_counter()
        draft_rt = rt.quantized(bits)
        head = quantize_columns(rt.head_weight() if vocab is None else rt.head_columns(vocab), bits)
        made = time.perf_counter() - t0
        shared, own, overlap = [], [], []
        for ids, start in seqs:
            a, b, c = agreement(m, draft_rt, head, vocab, ids, start)
            shared += a
            own += b
            overlap += c
        extra = sum(w.nbytes for L in draft_rt.layers for k, w in L.items() if hasattr(w, "bits")) + head.nbytes
        with torch.inference_mode():
            t_draft = step_time(lambda: draft_rt.logits(draft_rt.run_layers(draft_rt.embed(one), 0, rt.num_layers, 100, cache), head=head))
        table.add_row(name, f"{statistics.mean(shared):.1%}", f"{statistics.mean(own):.1%}", f"{statistics.mean(overlap):.3f}",
                      f"{extra / 1e6:.0f} ({extra / bf16_bytes:.2f}x)", f"{t_draft / t_ar:.2f}")
        console.print(f"{name}: made in {made:.1f}s; draft token {t_draft * 1e3:.1f} ms, AR step {t_ar * 1e3:.1f} ms")
        del draft_rt
    console.print(table)


if __name__ == "__main__":
    main()
