"""Logprobs in OpenAI's response shapes (the numbers come from logprobs.py).

chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}, the
             prompt's tokens first with echo (its first token's logprob and alternatives null).
A -inf log-probability is sent as logprobs.FLOOR. Every generated token has its entry, the one
that ended a choice (an EOS or a stop token id) too, with empty text (as vLLM): lm-eval's
loglikelihood reads the prompt's entries plus exactly one generated entry, whatever it is.

`bytes` are the token's own bytes: a byte-fallback token `<0x..>` is that byte, a byte-level
BPE token (GPT-2's alphabet) the bytes its characters stand for, so a character split over
tokens is split over their bytes. `text_offset` follows the detokenised text (TextOffsets).
"""

from __future__ import annotations

import re
from functools import lru_cache

from selfspec.logprobs import TokenLogprob, json_value

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPIECE_SPACE = "\u2581"  # SentencePiece's word-start mark: a space


def _text(tok, t: int) -> str:
    return tok.decode([t]) if tok is not None else str(t)


@lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet: character -> the byte it stands for. Printable Latin-1 bytes
    stand for themselves; the others, in byte order, are the characters from U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {chr(b): b for b in keep}
    moved = [b for b in range(256) if chr(b) not in chars]
    chars.update({chr(256 + i): b for i, b in enumerate(moved)})
    return chars


def _is_byte_level(tok) -> bool:
    backend = getattr(tok, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in str(backend.decoder)


@lru_cache(maxsize=1 << 16)
def token_bytes(tok, t: int) -> bytes:
    """The bytes of token t (module doc)."""
    if tok is None:
        return str(t).encode()
    piece = tok.convert_ids_to_tokens(t) if hasattr(tok, "convert_ids_to_tokens") else None
    if not isinstance(piece, str):
        return _text(tok, t).encode()
    if m := _BYTE_TOKEN.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    if _is_byte_level(tok):
        chars = _byte_level_chars()
        if all(c in chars for c in piece):
            return bytes(chars[c] for c in piece)
        return piece.encode()  # an added token, kept as written
    if SPIECE_SPACE in piece:
        return piece.replace(SPIECE_SPACE, " ").encode()
    return _text(tok, t).encode()


def chat_logprobs(entries: list[TokenLogprob], tok, ending=frozenset()) -> dict:
    """entries: a choice's generated tokens; a token in `ending` (EOS, stop token ids) shows no text."""

    def one(t: int, lp: float, silent: bool = False) -> dict:
        return {"token": "" if silent else _text(tok, t), "logprob": json_value(lp),
                "bytes": [] if silent else list(token_bytes(tok, t))}

    return {"content": [{**one(e.token, e.logprob, e.token in ending), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


class TextOffsets:
    """Where each token's text starts in the text its tokens decode to (skip_special_tokens, as
    a completion's text is decoded). Decoding token by token gets this wrong (SentencePiece drops
    a word's leading space when its token is decoded alone; a character split over byte tokens
    decodes to one replacement character per token), so each token's text is the growth of
    the decoded text of a short window of tokens before it: a token that ends inside a
    character adds nothing, the token that completes it adds the character."""

    def __init__(self, tok, start: int = 0):
        self.tok, self.length = tok, start
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the window: ids[prefix:read] decoded before, ids[prefix:] now

    def add(self, t: int) -> int:
        """-> the offset of token t, appended."""
        at = self.length
        if self.tok is None:
            self.length += len(str(t))
            return at
        self.ids.append(t)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.length += len(after) - len(before)
            self.prefix, self.read = self.read, len(self.ids)
        return at


class CompletionLogprobs:
    """Completions' logprobs object, built in pieces (a stream's chunks): with echo the prompt's
    first, then the completion's. `ending`: token ids that end a choice (shown with no text)."""

    def __init__(self, tok, top: int, ending=frozenset()):
        self.tok, self.top, self.ending = tok, top, frozenset(ending)
        self.offsets = TextOffsets(tok)

    def prompt(self, entries: list[TokenLogprob | None], ids: list[int], text: str) -> dict:
        """The prompt's piece (an entry None: its first token, with nothing before it); `text`:
        the echoed prompt, after which the completion (decoded alone) starts."""
        out = self._piece([(t, e, False) for t, e in zip(ids, entries)])
        self.offsets = TextOffsets(self.tok, start=len(text))
        return out

    def piece(self, entries: list[TokenLogprob]) -> dict:
        return self._piece([(e.token, e, e.token in self.ending) for e in entries])

    def _piece(self, rows: list[tuple[int, TokenLogprob | None, bool]]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, e, silent in rows:
            out["tokens"].append("" if silent else _text(self.tok, t))
            out["token_logprobs"].append(None if e is None else json_value(e.logprob))
            out["top_logprobs"].append(None if e is None else self._alternatives(e))
            out["text_offset"].append(self.offsets.length if silent else self.offsets.add(t))
        return out

    def _alternatives(self, e: TokenLogprob) -> dict[str, float]:
        """{text: logprob}, best first; of two tokens with one text, the likelier (OpenAI's shape keys by text)."""
        alts: dict[str, float] = {}
        for a, lp in e.top:
            alts.setdefault(_text(self.tok, a), json_value(lp))
        return alts


def merged(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}
