"""The generation options of a request body, one small parser per field (parsing.py runs them):
each returns the field's value for the engine or raises a 400 in OpenAI's shape naming it."""

from __future__ import annotations

import math

from selfspec.config import COUPLINGS, SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec.server.errors import bad

MAX_N = 16  # the most choices one request may ask for (each is a sequence of the batch)
MAX_STOP_TOKEN_IDS = 64


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def parse_n(n) -> int:
    if n is None:
        return 1
    if not is_int(n):
        raise bad("'n' must be an integer.", param="n", code="invalid_type")
    if not 1 <= n <= MAX_N:
        raise bad(f"'n' must be in 1..{MAX_N}, got {n}.", param="n", code="invalid_value")
    return n


def parse_stop_token_ids(ids, vocab_size: int) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise bad("'stop_token_ids' must be a list of token ids.", param="stop_token_ids", code="invalid_type")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"At most {MAX_STOP_TOKEN_IDS} stop token ids are allowed.", param="stop_token_ids", code="invalid_value")
    bad_ids = [t for t in ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad(f"Stop token id {bad_ids[0]} is outside the vocabulary (size {vocab_size}).", param="stop_token_ids",
                  code="invalid_value")
    return tuple(sorted(set(ids)))


def parse_sampling(body: dict) -> SamplingConfig:
    t = body.get("temperature")
    if t is None:
        t = 1.0
    if not is_num(t):
        raise bad("'temperature' must be a number.", param="temperature", code="invalid_type")
    if not 0 <= t <= 2:
        raise bad(f"'temperature' must be in [0, 2], got {t}.", param="temperature", code="invalid_value")
    top_p = body.get("top_p")
    if top_p is not None:
        if not is_num(top_p):
            raise bad("'top_p' must be a number.", param="top_p", code="invalid_type")
        if not 0 < top_p <= 1:
            raise bad(f"'top_p' must be in (0, 1], got {top_p}.", param="top_p", code="invalid_value")
        top_p = None if top_p == 1 else float(top_p)
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k):
            raise bad("'top_k' must be an integer.", param="top_k", code="invalid_type")
        if top_k < -1:
            raise bad(f"'top_k' must be >= 1 (0 or -1: off), got {top_k}.", param="top_k", code="invalid_value")
        top_k = None if top_k <= 0 else top_k
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise bad("'seed' must be an integer.", param="seed", code="invalid_type")
        if not -(2**63) <= seed < 2**64:
            raise bad("'seed' must fit in 64 bits.", param="seed", code="invalid_value")
    try:
        return SamplingConfig(temperature=float(t), top_k=top_k, top_p=top_p, seed=seed)
    except SelfSpecError as e:
        raise bad(str(e), code="invalid_value") from None


def parse_stop(stop, max_stop: int) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or a list of strings.", param="stop", code="invalid_type")
    if len(stop) > max_stop:
        raise bad(f"At most {max_stop} stop strings are allowed.", param="stop", code="invalid_value")
    return tuple(s for s in stop if s)


def parse_coupling(ext, default: str):
    """(the request's coupling, the `selfspec` object without it): the server's rule when the
    object names none."""
    if not isinstance(ext, dict) or "coupling" not in ext:
        return default, ext
    c = ext["coupling"]
    if not isinstance(c, str):
        raise bad("'selfspec.coupling' must be a string.", param="selfspec.coupling", code="invalid_type")
    if c not in COUPLINGS:
        raise bad(f"'selfspec.coupling' must be one of {', '.join(COUPLINGS)}, got {c!r}.", param="selfspec.coupling",
                  code="invalid_value")
    return c, {k: v for k, v in ext.items() if k != "coupling"}
