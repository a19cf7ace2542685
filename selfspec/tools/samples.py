"""The prompt records every measurement reads: Sample, Dataset (with the hash results files
record), and n-shot examples prepended to prompts."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from selfspec.errors import SelfSpecError


@dataclass
class Sample:
    id: str
    prompt: str
    reference: str | None = None
    task: str = "text"  # "code" | "text" | "summarize" | "custom"
    source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Dataset:
    name: str
    samples: list[Sample]
    description: str = ""
    seed: int = 0
    n_shot: int = 0
    template: str | None = None
    sources: list[str] = field(default_factory=list)

    @property
    def hash(self) -> str:
        h = hashlib.sha256()
        for s in self.samples:
            h.update(json.dumps([s.prompt, s.reference], ensure_ascii=False).encode())
        return h.hexdigest()[:16]

    def info(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "num_samples": len(self.samples),
            "seed": self.seed,
            "n_shot": self.n_shot,
            "template": self.template,
            "hash": self.hash,
            "sources": self.sources,
            "python": sys.version.split()[0],
        }

    def __len__(self) -> int:
        return len(self.samples)


def with_shots(chosen: list[Sample], pool: list[Sample], n_shot: int, seed: int, fmt: Callable[[Sample], str]) -> None:
    """Prepend n examples (with their references) drawn from `pool` to every chosen prompt."""
    if n_shot == 0:
        return
    shots = [s for s in pool if s.reference]
    if len(shots) < n_shot:
        raise SelfSpecError(f"--n-shot {n_shot}: only {len(shots)} examples with references are available")
    shots = random.Random(seed + 1).sample(shots, n_shot)
    prefix = "".join(fmt(s) for s in shots)
    for s in chosen:
        s.prompt = prefix + s.prompt


def shot_plain(s: Sample) -> str:
    return s.prompt + (s.reference or "") + "\n\n"


def shot_summary(s: Sample) -> str:  # LayerSkip: "Article: ...\nSummary: <one line>\n", then a blank line
    return s.prompt + " " + (s.reference or "").replace("\n", " ") + "\n\n"
