"""Seeded sampled outputs of plain, unscreened decoding, stored (tests/data/seeded_outputs.json)
so that a change to how a sampled token is computed (the screened Gumbel pick, sampled_head.py)
is checked against the texts the code gave before it: `python tests/seeded_cases.py` wrote
them, from the code before the screen existed.

Tiny models with a 2048-token vocabulary (a head the screen can leave mostly unread), fp32 and
bf16, every sampling shape (temperature alone, top-k, top-p, both, a processor and min_p), the
strategies whose verify rows the screen reads, solo and in generate_batch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import selfspec
from selfspec.tools.builtin_sets import builtin_set

sys.path.insert(0, str(Path(__file__).parent))

import helpers  # noqa: E402

DATA = Path(__file__).parent / "data" / "seeded_outputs.json"
VOCAB = 2048
N_NEW = 24
ARCHS = ("llama", "gemma3")
DTYPES = ("float32", "bfloat16")
SAMPLINGS = [
    dict(temperature=1.0, seed=21),
    dict(temperature=0.8, seed=22),
    dict(temperature=0.7, top_k=20, seed=23),
    dict(temperature=0.8, top_p=0.95, seed=24),
    dict(temperature=1.1, top_k=50, top_p=0.9, seed=25),
    dict(temperature=0.9, repetition_penalty=1.3, min_p=0.05, seed=26),
]
STRATEGIES = {
    "autoregressive": dict(strategy="autoregressive"),
    "quantized": dict(strategy="quantized", num_speculations=4),
    "prompt-lookup": dict(strategy="prompt-lookup"),
    "early-exit": dict(strategy="early-exit", exit_layer=2, num_speculations=3),
    "auto": dict(strategy="auto"),
}
BATCH_STRATEGY = "quantized"
# the default model (slow tests): the OpenAI default and the shapes, real prompts
DEFAULT_SAMPLINGS = [dict(temperature=1.0, seed=31), dict(temperature=0.8, top_p=0.95, seed=32),
                     dict(temperature=0.8, top_k=40, seed=33)]
DEFAULT_STRATEGIES = ("autoregressive", "auto")
DEFAULT_N_NEW = 32


def prompts() -> list[list[int]]:
    return helpers.prompts(vocab=VOCAB, n=2, seed=5, lengths=(7, 10)) + [[70, 80, 90, 100, 70, 80, 90, 100, 70]]


def default_prompts() -> list[str]:
    return [builtin_set("code", 1, 0, 0).samples[0].prompt, builtin_set("chat", 1, 0, 0).samples[0].prompt]


def tiny_model(zoo_get, arch: str, dtype: str):
    """The case's model: zoo_get(arch, dtype=..., vocab_size=...) (conftest's zoo.get or load_tiny)."""
    return zoo_get(arch, dtype=dtype, vocab_size=VOCAB)[1]


def tiny_outputs(model) -> dict:
    """{"<strategy>|<sampling index>|<prompt index>": token ids, "batch|<s>": [ids per prompt]}."""
    out = {}
    for name, kw in STRATEGIES.items():
        for si, s in enumerate(SAMPLINGS):
            for pi, p in enumerate(prompts()):
                out[f"{name}|{si}|{pi}"] = model.generate(p, max_new_tokens=N_NEW, **s, **kw).token_ids
    for si, s in enumerate(SAMPLINGS):
        got = model.generate_batch(prompts(), max_new_tokens=N_NEW, **s, **STRATEGIES[BATCH_STRATEGY])
        out[f"batch|{si}"] = [r.token_ids for r in got]
    return out


def default_outputs(model) -> dict:
    out = {}
    for name in DEFAULT_STRATEGIES:
        for si, s in enumerate(DEFAULT_SAMPLINGS):
            for pi, p in enumerate(default_prompts()):
                out[f"{name}|{si}|{pi}"] = model.generate(p, max_new_tokens=DEFAULT_N_NEW, strategy=name, **s).token_ids
    return out


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    if "tiny" in argv:
        data["tiny"] = {f"{a}|{d}": tiny_outputs(tiny_model(helpers.load_tiny, a, d)) for a in ARCHS for d in DTYPES}
    if "default" in argv:
        data["default_bf16"] = default_outputs(selfspec.load("gemma-3-270m", dtype="bfloat16"))
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(data, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
