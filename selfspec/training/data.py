"""Training text: read documents, hold out a deterministic slice, tokenize, pack.

Sources (`--data`, several allowed):
  PATH.jsonl   one JSON object per line: {"text": ...}, or {"prompt": ..., "response": ...}
               (the loss then covers the response and its end-of-text token only)
  PATH         a text file, or a directory: every *.py *.txt *.md *.rst below it (sorted)
  hf:NAME[:config]:split   a Hugging Face data set through `datasets`, from its local cache only
  stdlib       offline: the Python standard library's source (tests and codec tables left
               out), the language reference in `pydoc_data.topics`, and license texts found
               on this machine (see selfspec.tools.builtin_sets.license_files)

Held-out documents are chosen by a hash of their name, so the split does not depend on
which other documents exist; when that leaves nothing (a single file), the last
`eval_fraction` of the token stream is held out instead.

Packing (nanoGPT style): every document's tokens (the tokenizer's own special tokens, plus
an end-of-text token) are concatenated into one stream `ids`, with a parallel mask `target`
saying which tokens are trained on as next-token targets. Sequence k is
    inputs  = ids[k*T     : k*T + T]
    targets = ids[k*T + 1 : k*T + T + 1]   (weighted by target[k*T + 1 : k*T + T + 1])
so consecutive sequences share one boundary token and no token is wasted.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from selfspec.errors import SelfSpecError
from selfspec.tools.builtin_sets import license_files, topics
from selfspec.tools.datasets import hf_load, parse_hf_spec
from selfspec.training.config import DataConfig

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git", ".venv", "node_modules"}
# Standard-library parts that are not useful text: the test suite, codec tables, bundled wheels.
_STDLIB_SKIP = _SKIP_DIRS | {"test", "tests", "encodings", "ensurepip", "pydoc_data", "idle_test"}
TOKENIZER_TRAIN_BYTES = 16_000_000  # a BPE vocabulary is learnt from at most this much text
EOT = "<|endoftext|>"


@dataclass
class Document:
    id: str  # stable name: decides the train / held-out split
    text: str | None = None  # plain text: every token is a target
    prompt: str | None = None  # or a prompt/response pair: only the response is a target
    response: str | None = None

    def all_text(self) -> str:
        return self.text if self.text is not None else f"{self.prompt}{self.response}"


# ---- reading -------------------------------------------------------------------------------


def _walk(root: Path, skip: set[str], suffixes=TEXT_SUFFIXES) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes)]
    return out


def _read_text(path: Path, strict: bool) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        if strict:
            raise SelfSpecError(f"cannot read {path} as UTF-8 text: {e}") from e
        return None


def stdlib_documents() -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for p in _walk(root, _STDLIB_SKIP):
        t = _read_text(p, strict=False)
        if t and t.strip():
            docs.append(Document(f"stdlib:{p.relative_to(root).as_posix()}", t))
    docs += [Document(f"pydoc:{k}", topics[k]) for k in sorted(topics) if topics[k].strip()]

    docs += [Document(f"license:{where}:{hashlib.sha256(text.encode()).hexdigest()[:8]}", text) for where, text in license_files()]
    return docs


def _jsonl_documents(path: Path, cfg: DataConfig) -> list[Document]:
    docs = []
    text = _read_text(path, strict=True)
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SelfSpecError(f"{path}:{n} is not valid JSON: {e.msg}") from e
        doc = _row_document(row, f"{path.name}:{n}", cfg, f"{path}:{n}")
        if doc is not None:
            docs.append(doc)
    return docs


def _row_document(row, doc_id: str, cfg: DataConfig, where: str) -> Document | None:
    if not isinstance(row, dict):
        raise SelfSpecError(f"{where}: expected a JSON object with {cfg.text_field!r} or {cfg.prompt_field!r} + {cfg.response_field!r}")
    if isinstance(row.get(cfg.text_field), str):
        return Document(doc_id, row[cfg.text_field]) if row[cfg.text_field].strip() else None
    p, r = row.get(cfg.prompt_field), row.get(cfg.response_field)
    if isinstance(p, str) and isinstance(r, str):
        return Document(doc_id, prompt=p, response=r) if r.strip() else None
    raise SelfSpecError(f"{where}: no {cfg.text_field!r} string and no {cfg.prompt_field!r} + {cfg.response_field!r} strings")


def _hf_documents(spec: str, cfg: DataConfig) -> list[Document]:
    data = hf_load(*parse_hf_spec(spec))  # the local datasets cache only, as the evaluation sets
    return [d for i, row in enumerate(data) if (d := _row_document(row, f"{spec}[{i}]", cfg, f"{spec} row {i}")) is not None]


def read_documents(cfg: DataConfig) -> list[Document]:
    docs: list[Document] = []
    for src in cfg.data:
        if src == "stdlib":
            found = stdlib_documents()
        elif src.startswith("hf:"):
            found = _hf_documents(src, cfg)
        else:
            path = Path(src).expanduser()
            if not path.exists():
                raise SelfSpecError(f"data not found: {src!r} (a file, a directory, hf:NAME:split or stdlib)")
            if path.is_dir():
                found = []
                for p in _walk(path, _SKIP_DIRS):
                    t = _read_text(p, strict=False)
                    if t and t.strip():
                        found.append(Document(f"{path.name}/{p.relative_to(path).as_posix()}", t))
            elif path.suffix == ".jsonl":
                found = _jsonl_documents(path, cfg)
            else:
                t = _read_text(path, strict=True)
                found = [Document(path.name, t)] if t.strip() else []
        if not found:
            raise SelfSpecError(f"no text found in {src!r}")
        docs += found
    seen: set[bytes] = set()
    unique = []
    for d in docs:  # the same text twice (a license under two names) would leak into the held-out split
        key = hashlib.sha256(d.all_text().encode()).digest()
        if key not in seen:
            seen.add(key)
            unique.append(d)
    docs = unique
    if cfg.exclude_containing:
        docs = [d for d in docs if not any(s in d.all_text() for s in cfg.exclude_containing)]
        if not docs:
            raise SelfSpecError("--exclude-containing removed every document")
    return docs


def is_held_out(doc_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


# ---- tokenizers ----------------------------------------------------------------------------


def train_bpe_tokenizer(docs: list[Document], vocab_size: int):
    """A byte-level BPE tokenizer learnt from (up to TOKENIZER_TRAIN_BYTES of) `docs`, as a
    transformers fast tokenizer. `<|endoftext|>` (id 0) is BOS and EOS: it is put in front
    of every encoded text, and a model trained on it ends documents with it."""
    def texts():
        n = 0
        for d in docs:
            t = d.all_text()
            yield t
            n += len(t)
            if n >= TOKENIZER_TRAIN_BYTES:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, 0)])
    return bpe_tokenizer_from_json(tok.to_str())


def bpe_tokenizer_from_json(spec: str):
    """The transformers wrapper of a tokenizer made by train_bpe_tokenizer (its JSON form)."""
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec), bos_token=EOT, eos_token=EOT)


def load_tokenizer(path: str):
    local = Path(path).expanduser()
    if not local.is_dir():  # never a hub id: nothing may download at run time
        raise SelfSpecError(f"tokenizer directory not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(str(local), local_files_only=True)
    except Exception as e:
        raise SelfSpecError(f"cannot load a tokenizer from {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


# ---- tokenizing and packing ----------------------------------------------------------------


@dataclass
class TokenStream:
    ids: torch.Tensor  # [N] int64
    target: torch.Tensor  # [N] bool: token is trained on as a next-token target

    def __len__(self) -> int:
        return self.ids.numel()


def tokenize(docs: list[Document], tokenizer, max_tokens: int | None = None, batch: int = 256) -> TokenStream:
    """Documents -> one stream; each document ends with EOS unless the tokenizer already
    starts every text with the same token (then that BOS separates documents)."""
    eos = tokenizer.eos_token_id
    bos = getattr(tokenizer, "bos_token_id", None)
    ids: list[int] = []
    target: list[bool] = []
    for start in range(0, len(docs), batch):
        chunk = docs[start : start + batch]
        plain = [d for d in chunk if d.text is not None]
        enc = iter(tokenizer([d.text for d in plain]).input_ids) if plain else iter(())
        for d in chunk:
            if d.text is not None:
                a, b = next(enc), []
            else:
                a = tokenizer(d.prompt).input_ids
                b = tokenizer(d.response, add_special_tokens=False).input_ids
            doc = a + b
            if eos is not None and doc and doc[-1] != eos and not (bos == eos and doc[0] == bos):
                doc = doc + [eos]
            ids += doc
            if d.text is not None:
                target += [True] * len(doc)
            else:  # the prompt (and any BOS) is context only
                target += [False] * len(a) + [True] * (len(doc) - len(a))
        if max_tokens is not None and len(ids) >= max_tokens:
            ids, target = ids[:max_tokens], target[:max_tokens]
            break
    return TokenStream(torch.tensor(ids, dtype=torch.long), torch.tensor(target, dtype=torch.bool))


@dataclass
class PackedData:
    """A token stream cut into sequences of seq_len (+1 for the shifted targets)."""

    stream: TokenStream
    seq_len: int

    @property
    def num_sequences(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def sequences(self, index: torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> inputs [B, T], targets [B, T], weights [B, T] (bool) for sequence indices."""
        idx = torch.as_tensor(index, dtype=torch.long)
        offs = idx[:, None] * self.seq_len + torch.arange(self.seq_len + 1)[None]
        ids, tgt = self.stream.ids[offs], self.stream.target[offs]
        return ids[:, :-1], ids[:, 1:], tgt[:, 1:]

    def target_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each id is a target token: [V] int64."""
        s = self.stream
        counted = s.ids[1 : self.num_sequences * self.seq_len + 1][s.target[1 : self.num_sequences * self.seq_len + 1]]
        return torch.bincount(counted.clamp(max=vocab_size - 1), minlength=vocab_size)


def most_frequent_targets(data: PackedData, vocab_size: int, n: int) -> torch.Tensor:
    """The n most frequent target ids (ties by id), sorted by id."""
    counts = data.target_counts(vocab_size).double()
    order = torch.sort(-counts, stable=True).indices
    return order[: min(n, vocab_size)].sort().values


@dataclass
class Corpus:
    train: PackedData
    eval: PackedData
    num_documents: int
    num_eval_documents: int

    def eval_indices(self, n: int) -> list[int]:
        """n held-out sequences spread evenly over the held-out stream (deterministic)."""
        m = self.eval.num_sequences
        if m == 0:
            return []
        n = min(n, m)
        return sorted({(i * m) // n for i in range(n)})

    def describe(self) -> str:
        held = f"{self.num_eval_documents} documents" if self.num_eval_documents else "the end of the text"
        return (f"{self.num_documents} documents, {len(self.train.stream):,} training tokens "
                f"({self.train.num_sequences:,} sequences of {self.train.seq_len}), "
                f"{len(self.eval.stream):,} held-out tokens from {held}")


def build_corpus(docs: list[Document], tokenizer, cfg: DataConfig, seq_len: int | None = None) -> Corpus:
    T = seq_len or cfg.seq_len
    train_docs = [d for d in docs if not is_held_out(d.id, cfg.eval_fraction)]
    eval_docs = [d for d in docs if is_held_out(d.id, cfg.eval_fraction)]
    train = tokenize(train_docs, tokenizer, cfg.max_tokens)
    held = tokenize(eval_docs, tokenizer)
    if cfg.eval_fraction > 0 and len(held) < T + 1:
        # too few documents to hold any out: keep the tail of the stream instead
        cut = max(T + 1, int(len(train) * cfg.eval_fraction))
        if len(train) - cut >= T + 1:
            held = TokenStream(train.ids[-cut:], train.target[-cut:])
            train = TokenStream(train.ids[:-cut], train.target[:-cut])
            eval_docs = []
    corpus = Corpus(PackedData(train, T), PackedData(held, T), len(docs), len(eval_docs))
    if corpus.train.num_sequences == 0:
        raise SelfSpecError(f"too little training text: {len(train)} tokens, fewer than one sequence of --seq-len {T} + 1")
    if not bool(train.target[1:].any()):
        raise SelfSpecError("the training data has no target tokens (every jsonl response is empty?)")
    return corpus


# ---- data order ----------------------------------------------------------------------------


def sequence_order(num_sequences: int, seed: int, position: int, count: int) -> list[int]:
    """Sequence indices number position..position+count-1 of an endless walk over the data:
    a fresh seeded permutation per epoch, so any position can be resumed without state."""
    out: list[int] = []
    while len(out) < count:
        epoch, offset = divmod(position + len(out), num_sequences)
        perm = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out += perm[offset : offset + count - len(out)].tolist()
    return out
