"""Structured output: JSON (any object, or a JSON schema), a regular expression or a Lark grammar,
with llguidance (Microsoft's grammar engine: a Rust library on PyPI with no dependencies; a
token mask costs tens of microseconds on a 262k vocabulary, and its matcher rolls back).

A generation's `Matcher` follows its committed tokens; the processors (processors.py) ask it for
the tokens allowed after the committed text plus some drafts (`allowed(drafted)`): it consumes
the drafts it has not consumed yet, after rolling back those that differ, so drafting and
verification move it a few tokens forward and back, and `commit(tokens)` rolls every draft back
and consumes what was accepted. A rejected draft thus leaves it exactly where autoregressive
decoding leaves it. Masks are kept per state until the next commit (a draft's row and the verify
row at the same position share one).

`forced(most)`: the tokens the grammar forces next, for free drafts that no drafter computes:
first every position where the grammar allows exactly one token (accepted whatever the model
says: the target puts all its mass there), then llguidance's fast-forward tokens (the canonical
tokenization of the bytes the grammar forces; the model may tokenize them otherwise, so these
are verified like any draft). JSON is compiled with fixed whitespace (", " and ": "), the form
small models write, so that separators and keys are forced.
"""

from __future__ import annotations

import json
import threading
import weakref
from functools import lru_cache

import llguidance
import llguidance.hf
import numpy as np
import torch

from selfspec.config import Grammar
from selfspec.errors import SelfSpecError
from selfspec.json_schema import closed

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> LLTokenizer
_lock = threading.Lock()


@lru_cache(maxsize=64)
def compile_grammar(g: Grammar) -> str:
    """The llguidance grammar of g (its own JSON form); SelfSpecError when g is malformed. A JSON
    schema is closed first: no properties or items it does not name (json_schema.py)."""
    if g.kind in ("json_object", "json_schema"):
        try:
            schema = json.loads(g.source) if g.kind == "json_schema" else {"type": "object"}
        except ValueError as e:
            raise SelfSpecError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise SelfSpecError("the JSON schema must be a JSON object")
        try:
            text = llguidance.LLMatcher.grammar_from_json_schema(closed(schema), overrides=JSON_OPTIONS)
        except ValueError as e:
            raise SelfSpecError(f"the JSON schema is not usable: {e}") from None
    elif g.kind == "regex":
        text = llguidance.LLMatcher.grammar_from_regex(g.source)
    else:
        text = llguidance.LLMatcher.grammar_from_lark(g.source)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error and not error.startswith("WARNING"):
        raise SelfSpecError(f"the {g.kind.replace('_', ' ')} grammar is not valid: {error.strip().splitlines()[0]}")
    return text


def ll_tokenizer(model) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer over its vocabulary (made once per model: it takes
    seconds for a 262k vocabulary)."""
    with _lock:
        if model not in _tokenizers:
            if model.tokenizer is None:
                raise SelfSpecError("structured output needs the model's tokenizer")
            try:
                _tokenizers[model] = llguidance.hf.from_tokenizer(model.tokenizer, n_vocab=model.spec.vocab_size,
                                                                  eos_token=list(model.eos_token_ids) or None)
            except ValueError as e:
                raise SelfSpecError(f"structured output cannot use this tokenizer: {e}") from None
        return _tokenizers[model]


def grammar_matcher(model, g: Grammar) -> Matcher:
    """A matcher of g for one generation of model."""
    return Matcher(ll_tokenizer(model), compile_grammar(g), model.spec.vocab_size, model.eos_token_ids)


class Matcher:
    """One generation's grammar state (module doc)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int, eos_ids=()):
        self.m = llguidance.LLMatcher(tokenizer, grammar)
        if self.m.is_error():
            raise SelfSpecError(f"the grammar is not usable: {self.m.get_error()}")
        self.vocab_size = vocab_size
        self.eos = torch.zeros(vocab_size, dtype=torch.bool)
        self.eos[[t for t in eos_ids if t < vocab_size]] = True
        self.drafted: list[int] = []  # consumed on top of the committed tokens
        self.reachable = True  # every drafted token was allowed
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    def _sync(self, drafted) -> None:
        """Consume the longest valid prefix of `drafted` on top of the committed tokens;
        `reachable`: all of it was valid. The matcher only ever consumes valid tokens (an invalid
        one would put it in an error state for good), so it always sits at a real state."""
        drafted = list(drafted)
        same = 0
        while same < min(len(drafted), len(self.drafted)) and drafted[same] == self.drafted[same]:
            same += 1
        if same < len(self.drafted):
            self.m.rollback(len(self.drafted) - same)
            self.drafted = self.drafted[:same]
        if same < len(drafted):
            n = self.m.validate_tokens(drafted[same:])
            if n:
                self.m.consume_tokens(drafted[same: same + n])
            self.drafted += drafted[same: same + n]
        # decided afresh at every sync: a state left unreachable by a longer query is reachable again
        self.reachable = self.drafted == drafted

    def allowed(self, drafted=()) -> torch.Tensor:
        """bool [vocab]: the tokens allowed after the committed tokens and `drafted` (a state the
        drafts cannot reach: end of sequence only; no row of it is ever used)."""
        key = tuple(drafted)
        if key not in self._masks:
            self._sync(key)
            self._masks[key] = self._mask() if self.reachable else self.eos
        return self._masks[key]

    def _mask(self) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")[: self.vocab_size]
        mask = torch.from_numpy(bits.astype(bool))
        return mask if bool(mask.any()) else self.eos  # the grammar is done (or in error): only an end

    def commit(self, tokens) -> None:
        """tokens were accepted: they are consumed for good, the drafts rolled back."""
        self._sync(())
        self.m.consume_tokens(list(tokens))
        self._masks.clear()

    def forced(self, most: int) -> tuple[list[int], int]:
        """(up to `most` tokens to draft for free, how many of them are certain: the grammar
        allows exactly that token) from the committed state (module doc)."""
        chain: list[int] = []
        while len(chain) < most:
            ids = torch.nonzero(self.allowed(chain)).flatten()
            if len(ids) != 1 or bool(self.eos[ids[0]]):
                break
            chain.append(int(ids[0]))
        certain = len(chain)
        if len(chain) < most:
            self._sync(chain)
            if self.reachable:
                chain += self.m.compute_ff_tokens()[: most - len(chain)]
        return chain, certain
