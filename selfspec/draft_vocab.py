"""The restricted draft vocabulary (FR-Spec): draft logits over the N most frequent tokens.

On Gemma 3 270M the LM head is 168M of 268M parameters, so a draft token's cost is mostly
the head; computing it over 16k instead of 262k ids cuts that by 16x. Verification always
uses the full head, so greedy output is unchanged; for sampling the draft distribution is
the restricted one and the acceptance rule stays exact.

Frequencies are counted on text that ships with every Python: the standard library's
source and its license (a few MB), tokenized with the model's tokenizer. The ordering is
cached per tokenizer under the selfspec cache directory.
"""

from __future__ import annotations

import hashlib
import io
import sysconfig
from collections import Counter
from pathlib import Path

import torch

from selfspec.errors import SelfSpecError
from selfspec.profiles import atomic_write_bytes


def corpus_texts(max_bytes: int = 4_000_000) -> list[str]:
    """Deterministic sample of the standard library source (sorted paths, every 3rd file)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    texts, total = [], 0
    for p in files[::3]:
        try:
            t = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(t)
        total += len(t)
        if total >= max_bytes:
            break
    for name in ("LICENSE.txt", "LICENSE"):
        lic = root / name
        if lic.exists():
            texts.append(lic.read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise SelfSpecError("found no text to count token frequencies on (no standard library source?)")
    return texts


def frequency_order(tokenizer, vocab_size: int, texts: list[str] | None = None) -> torch.Tensor:
    """All token ids, most frequent first (ties and unseen ids by id), special tokens first."""
    counts: Counter[int] = Counter()
    for t in texts if texts is not None else corpus_texts():
        counts.update(tokenizer(t, add_special_tokens=False).input_ids)
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size]
    score = torch.zeros(vocab_size, dtype=torch.float64)
    for i, c in counts.items():
        if 0 <= i < vocab_size:
            score[i] = c
    score[special] = float("inf")  # EOS and friends are always draftable
    # stable sort on -score keeps id order among ties
    return torch.sort(-score, stable=True).indices


def cached_frequency_order(tokenizer, vocab_size: int, cache_dir: Path) -> torch.Tensor:
    key = hashlib.sha256(f"{vocab_size}:{len(tokenizer)}:{tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, 2000))))}".encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"token-order-{key}.pt"
    if path.exists():
        try:
            order = torch.load(path)
            if order.shape == (vocab_size,):
                return order
        except Exception:
            pass  # a damaged cache file: recount
    order = frequency_order(tokenizer, vocab_size)
    buf = io.BytesIO()
    torch.save(order, buf)
    atomic_write_bytes(path, buf.getvalue())
    return order
