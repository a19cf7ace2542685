"""Prompt lookup's draft: copy what followed the last earlier occurrence of the context's
suffix. A pure function on token lists, shared by the drafter and the speedup simulation."""

from __future__ import annotations


def lookup_continuation(tokens: list[int], max_ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (n <= max_ngram) of tokens; [] when no suffix n-gram occurred before."""
    if k <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # most recent first
            if tokens[start : start + n] == suffix:
                cont = tokens[start + n : start + n + k]
                if cont:
                    return list(cont)
    return []
