"""What the operator decides (`ServerSettings`), and the limits derived from it and the model.

Imports nothing of the web stack, so the CLI can validate flags before loading anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from selfspec import strategies
from selfspec.coercion import coerce_fields
from selfspec.config import COUPLINGS, MAX_SPECULATIONS, SamplingConfig
from selfspec.errors import SelfSpecError

# Draft options a request may set in its `selfspec` object. Never draft_model (a path on the
# server's disk) nor draft_vocab (allocates a slice of the LM head per value).
REQUEST_DRAFT_OPTIONS = (
    "strategy",
    "exit_layer",
    "num_speculations",
    "skip_attn",
    "skip_mlp",
    "draft_threshold",
    "adaptive",
    "max_ngram",
)
MAX_REQUEST_NGRAM = 8
PROMPT_TOKENS_PER_CORE = 2048  # default prompt limit per CPU core (see default_max_prompt_tokens)


@dataclass
class ServerSettings:
    """What the operator decides. Validated on creation (SelfSpecError)."""

    model_name: str = "selfspec"  # the `model` id clients send and /v1/models lists
    aliases: tuple[str, ...] = ()  # other accepted `model` values (e.g. the --model path)
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer KEY`
    max_concurrency: int = 16  # requests admitted at once (in the batch + waiting for a slot); more -> 429
    queue_timeout_s: float = 30.0  # waiting longer than this for the engine -> 503
    max_new_tokens_limit: int = 1024  # max_tokens above this -> 400
    default_max_tokens: int = 128  # when a request gives no max_tokens
    allowed_strategies: tuple[str, ...] | None = None  # per-request strategies; None = all but draft-model
    max_num_speculations: int = MAX_SPECULATIONS  # per-request K cap
    allow_request_draft: bool = True  # honour the `selfspec` extension object at all
    max_stop: int = 16  # most stop strings per request
    max_request_bytes: int = 8 * 1024 * 1024  # larger bodies -> 413
    max_prompt_tokens: int | None = None  # longer prompts -> 400; None: default_max_prompt_tokens
    prefill_chunk: int | None = None  # prompt rows per batch step (running streams wait one chunk, not a prompt); None: batch.default_prefill_chunk()
    max_batch: int | None = None  # sequences decoding at once; None: default_max_batch() (from the CPU count)
    replica_id: str = ""  # shown in the X-SelfSpec-Replica header and the stats (Ray Serve)
    coupling: str = SamplingConfig.coupling  # sampled requests' rule unless they name one ("selfspec": {"coupling": ...})

    def __post_init__(self):
        coerce_fields(self)
        self.aliases = tuple(a for a in self.aliases if a and a != self.model_name)
        if not self.model_name:
            raise SelfSpecError("the served model name is empty")
        for name in ("max_concurrency", "max_new_tokens_limit", "default_max_tokens", "max_stop", "max_request_bytes"):
            v = getattr(self, name)
            if v < 1:
                raise SelfSpecError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_prompt_tokens", "max_batch", "prefill_chunk"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise SelfSpecError(f"{name} must be a positive integer, got {v!r}")
        if not (self.queue_timeout_s > 0):
            raise SelfSpecError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s!r}")
        if not 1 <= self.max_num_speculations <= MAX_SPECULATIONS:
            raise SelfSpecError(f"max_num_speculations must be in 1..{MAX_SPECULATIONS}, got {self.max_num_speculations}")
        if self.allowed_strategies is not None:
            self.allowed_strategies = tuple(self.allowed_strategies)
            bad = [s for s in self.allowed_strategies if not strategies.known(s)]
            if bad:
                raise SelfSpecError(f"unknown strategy {bad[0]!r} in allowed strategies; choose from {', '.join(strategies.names())}")
        if self.coupling not in COUPLINGS:
            raise SelfSpecError(f"unknown coupling {self.coupling!r}; choose from {', '.join(COUPLINGS)}")
        self.default_max_tokens = min(self.default_max_tokens, self.max_new_tokens_limit)
        if self.api_key == "":
            self.api_key = None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def default_max_batch(cpus: int | None = None) -> int:
    """The batch size when the operator sets none: 4 sequences per CPU core, between 4 and 32.
    A decode step streams every weight once for the whole batch, so rows are nearly free
    until the pass becomes compute-bound; on the CPU that happens after a few rows per core
    (the batch planner then drafts less), and more sequences only lengthen every step."""
    cpus = cpus or os.cpu_count() or 1
    return max(4, min(32, 4 * cpus))


def default_max_prompt_tokens(context_length: int, cpus: int | None = None) -> int:
    """The prompt-token limit when the operator sets none: PROMPT_TOKENS_PER_CORE per CPU core
    (prefill is compute-bound: on the 2-core reference machine 4096 prompt tokens of the default
    model prefill in seconds, not minutes), never beyond what the context leaves for one new token."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(context_length - 1, PROMPT_TOKENS_PER_CORE * cpus))


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of this tokenizer stands for, from its vocabulary's
    pieces (byte-level pieces carry one character per byte, SentencePiece pieces one per
    character, so a piece is never shorter than the text it covers). A text of n characters
    therefore has at least n / this many tokens: the bound that rejects a huge prompt before
    tokenizing it."""
    if tokenizer is None:
        return 1
    vocab = tokenizer.get_vocab()
    return max((len(piece) for piece in vocab), default=1) or 1


@dataclass(frozen=True)
class PromptLimits:
    """Prompt limits of one served model: tokens (operator's or default), and the character
    bound that follows from them (prompt_tokens * the longest token in characters)."""

    context_length: int
    max_prompt_tokens: int
    max_prompt_chars: int

    @classmethod
    def for_model(cls, settings: ServerSettings, context_length: int, tokenizer) -> PromptLimits:
        limit = settings.max_prompt_tokens or default_max_prompt_tokens(context_length)
        limit = min(limit, context_length - 1)
        return cls(context_length, limit, limit * longest_token_chars(tokenizer))
