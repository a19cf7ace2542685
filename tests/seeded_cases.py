"""Seeded sampled outputs of plain, unscreened decoding, stored (tests/data/seeded_outputs.json)
so that a change to how a sampled token is computed (the screened Gumbel pick, sampled_head.py)
is checked against the texts the code gave before it: `python tests/seeded_cases.py` wrote
them, from the code before the screen existed. The texts hold for one chain of kernels: each entry
is keyed by the runtime's numerics, and a machine whose chain has no entry skips the comparison.

Tiny models with a 2048-token vocabulary (a head the screen can leave mostly unread), fp32 and
bf16, every sampling shape (temperature alone, top-k, top-p, both, a processor and min_p), the
strategies whose verify rows the screen reads, solo and in generate_batch. The processed rows
(issue 55's second part: min_p alone, penalties with top-p and min_p, a logit bias with top-k,
greedy with penalties and a bias) and a grammar model (tests/test_grammar.py's, a 320-token BPE
vocabulary: regex, Lark and JSON schema, greedy and seeded) were stored later, from the code before
processed rows went through the screen, with SELFSPEC_EXACT_PICKS=1 and SELFSPEC_EXACT_HEAD=1."""

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
    # processed rows through the screen (stored later, before they were: module doc)
    dict(temperature=1.0, min_p=0.1, seed=27),
    dict(temperature=0.8, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3, seed=28),
    dict(temperature=0.7, top_k=30, logit_bias={5: 4.0, 9: -100.0, 700: 2.5}, seed=29),
    dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, logit_bias={5: 1.5}),
    dict(temperature=1.2, top_k=50, min_p=0.2, repetition_penalty=1.2, seed=30),
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
                     dict(temperature=0.8, top_k=40, seed=33),
                     dict(temperature=0.8, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=34),
                     dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.2)]
DEFAULT_STRATEGIES = ("autoregressive", "auto")
DEFAULT_N_NEW = 32


# the grammar model (tests/test_grammar.py's tokenizer and model): grammar x sampling x strategy
GRAMMAR_SAMPLINGS = [dict(), dict(temperature=1.0, seed=41), dict(temperature=0.8, top_p=0.9, min_p=0.05, seed=42)]
GRAMMAR_STRATEGIES = {"autoregressive": dict(strategy="autoregressive"), "prompt-lookup": dict(strategy="prompt-lookup"),
                      "layer-skip": dict(strategy="layer-skip", skip_mlp=(1, 2)), "quantized": dict(strategy="quantized")}
GRAMMAR_KINDS = ("regex", "lark", "json_schema", "wide")  # wide: most of the vocabulary allowed at every position
GRAMMAR_N_NEW = 60


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


def grammar_model():
    """(tokenizer, model): tests/test_grammar.py's llama over its BPE tokenizer."""
    from test_grammar import bpe_tokenizer

    tok = bpe_tokenizer()
    return tok, selfspec.load(helpers.build_hf("llama", vocab_size=len(tok)), dtype="float32", tokenizer=tok)


def grammar_outputs(tok, model) -> dict:
    """{"<grammar>|<strategy>|<sampling index>": token ids, "batch|<grammar>|<s>": [ids per prompt]}."""
    from test_grammar import GRAMMARS

    from selfspec.config import Grammar

    grammars = {**GRAMMARS, "wide": Grammar("regex", "[a-z ]{10,40}\\.")}
    ps = [tok("the cat").input_ids, tok("the dog").input_ids]
    out = {}
    for kind in GRAMMAR_KINDS:
        for name, kw in GRAMMAR_STRATEGIES.items():
            for si, s in enumerate(GRAMMAR_SAMPLINGS):
                out[f"{kind}|{name}|{si}"] = model.generate(ps[0], max_new_tokens=GRAMMAR_N_NEW, grammar=grammars[kind], **s,
                                                            **kw).token_ids
        for si, s in enumerate(GRAMMAR_SAMPLINGS):
            got = model.generate_batch(ps, max_new_tokens=GRAMMAR_N_NEW, grammar=grammars[kind], **s, **GRAMMAR_STRATEGIES["quantized"])
            out[f"batch|{kind}|{si}"] = [r.token_ids for r in got]
    return out


def default_outputs(model) -> dict:
    out = {}
    for name in DEFAULT_STRATEGIES:
        for si, s in enumerate(DEFAULT_SAMPLINGS):
            for pi, p in enumerate(default_prompts()):
                out[f"{name}|{si}|{pi}"] = model.generate(p, max_new_tokens=DEFAULT_N_NEW, strategy=name, **s).token_ids
    return out


def tiny_key(arch: str, dtype: str, model) -> str:
    """The stored entry of a tiny case: its texts hold for one chain of kernels (runtime.numerics:
    bf16 runs VDPBF16PS pairs where the CPU has them, the fp32 FMA chain where it does not)."""
    return f"{arch}|{dtype}|{model.runtime.numerics}"


def main(argv: list[str]) -> None:
    """Adds this machine's chains to the stored entries (those of other chains are kept); run it
    with SELFSPEC_EXACT_PICKS=1 SELFSPEC_EXACT_HEAD=1 (plain, unscreened decoding)."""
    torch.set_num_threads(1)
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    if "tiny" in argv:
        for a in ARCHS:
            for d in DTYPES:
                model = tiny_model(helpers.load_tiny, a, d)
                data.setdefault("tiny", {})[tiny_key(a, d, model)] = tiny_outputs(model)
    if "grammar" in argv:
        data["grammar"] = grammar_outputs(*grammar_model())
    if "default" in argv:
        model = selfspec.load("gemma-3-270m", dtype="bfloat16")
        data.setdefault("default_bf16", {})[model.runtime.numerics] = default_outputs(model)
    DATA.parent.mkdir(exist_ok=True)
    tmp = DATA.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    tmp.replace(DATA)


if __name__ == "__main__":
    main(sys.argv[1:])
