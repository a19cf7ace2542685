"""Logprobs in OpenAI's response shapes (the numbers come from logprobs.py).

chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}, the
             prompt's tokens first with echo (its first token's logprob and alternatives null).
A -inf log-probability is sent as logprobs.FLOOR. The token that ended a choice (an EOS or a stop
token id) is not part of its text and has no entry.
"""

from __future__ import annotations

from selfspec.logprobs import TokenLogprob, json_value


def shown(result, params, eos_ids) -> list[TokenLogprob]:
    """The entries of the tokens whose text a choice returns."""
    entries = result.logprobs or []
    if result.token_ids and result.token_ids[-1] in set(eos_ids) | set(params.stop_token_ids) and result.finish_reason != "length":
        entries = entries[: len(result.token_ids) - 1]
    return entries


def _text(tok, t: int) -> str:
    return tok.decode([t]) if tok is not None else str(t)


def chat_logprobs(entries: list[TokenLogprob], tok) -> dict:
    def one(t: int, lp: float) -> dict:
        s = _text(tok, t)
        return {"token": s, "logprob": json_value(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


class CompletionLogprobs:
    """Completions' logprobs object, built in pieces (a stream's chunks) with running text offsets."""

    def __init__(self, tok, top: int):
        self.tok, self.top, self.offset = tok, top, 0

    def piece(self, entries: list[TokenLogprob | None], ids: list[int] | None = None) -> dict:
        """entries (None: a prompt token with nothing before it); ids: their tokens where an entry is None."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, e in enumerate(entries):
            t = e.token if e is not None else ids[i]
            s = _text(self.tok, t)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if e is None else json_value(e.logprob))
            out["top_logprobs"].append(None if e is None else self._alternatives(e))
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    def _alternatives(self, e: TokenLogprob) -> dict[str, float]:
        """{text: logprob}, best first; of two tokens with one text, the likelier (OpenAI's shape keys by text)."""
        alts: dict[str, float] = {}
        for a, lp in e.top:
            alts.setdefault(_text(self.tok, a), json_value(lp))
        return alts


def merged(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}
