"""The built-in prompt sets (code, text, summarize), cut from text that ships with Python and
the machine; see datasets.py for what each holds."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata as md
import os
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

from selfspec.errors import SelfSpecError
from selfspec.tools.samples import Dataset, Sample, shot_plain, shot_summary, with_shots

try:
    from pydoc_data.topics import topics
except ImportError:  # some distributions ship Python without pydoc_data: the python-docs group is then empty
    topics = {}

BUILTIN = ("code", "text", "summarize")
_EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings", "site-packages",
                  "dist-packages", "__pycache__", "ensurepip", "pydoc_data", "__phello__"}
TEXT_PROMPT_CHARS = 1000
TEXT_REFERENCE_CHARS = 500
CODE_MAX_PROMPT_CHARS = 1500
SUMMARY_MAX_ARTICLE_CHARS = 2500


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(seed: int, salt: str) -> list[Path]:
    root = stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".py"):
                files.append(Path(dirpath) / f)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    random.Random(f"{salt}/{seed}").shuffle(files)  # each set its own order of modules
    return files


def _parse(path: Path) -> tuple[list[str], ast.Module] | None:
    try:
        src = path.read_text(encoding="utf-8")
        return src.splitlines(), ast.parse(src)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _rel(path: Path) -> str:
    try:
        return path.relative_to(stdlib_dir()).as_posix()
    except ValueError:
        return str(path)


def _code_candidates(path: Path) -> list[Sample]:
    parsed = _parse(path)
    if parsed is None:
        return []
    lines, tree = parsed
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if len(doc.value.value.strip()) < 20 or node.body[1].lineno <= doc.end_lineno:
            continue
        if lines[doc.end_lineno - 1][doc.end_col_offset :].strip():  # code after the docstring on its line
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        body = lines[doc.end_lineno : node.end_lineno]
        n_body = sum(1 for ln in body if ln.strip())
        if not 2 <= n_body <= 25:
            continue
        indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
        head = lines[start - 1 : doc.end_lineno]
        if any(ln.strip() and len(ln) - len(ln.lstrip()) < indent for ln in head + body):
            continue  # a continuation line left of the def (odd formatting): skip
        prompt = "\n".join(ln[indent:] for ln in head) + "\n"
        reference = "\n".join(ln[indent:] for ln in body).rstrip() + "\n"
        if len(prompt) > CODE_MAX_PROMPT_CHARS:
            continue
        rel = _rel(path)
        out.append(Sample(f"code:{rel}:{node.lineno}:{node.name}", prompt, reference, "code", f"{rel}:{start} (Python {_pyver()} stdlib)"))
    return out


def _pyver() -> str:
    return ".".join(map(str, sys.version_info[:2]))


def _split_summary(doc: str) -> tuple[str, str] | None:
    """Docstring -> (summary paragraph, the rest) when it has that shape."""
    doc = textwrap.dedent(doc).strip()
    parts = re.split(r"\n\s*\n", doc, maxsplit=1)
    if len(parts) != 2:
        return None
    summary, rest = " ".join(parts[0].split()), textwrap.dedent(parts[1]).strip()
    if not 25 <= len(summary) <= 200 or not 400 <= len(rest) <= SUMMARY_MAX_ARTICLE_CHARS:
        return None
    if summary.startswith(("Copyright", "Usage", ">>>")) or ">>>" in rest[:200]:
        return None
    return summary, rest


def _summary_candidates(path: Path) -> list[Sample]:
    parsed = _parse(path)
    if parsed is None:
        return []
    _, tree = parsed
    rel = _rel(path)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=True)
        split = _split_summary(doc) if doc else None
        if split is None:
            continue
        summary, rest = split
        name = getattr(node, "name", "<module>")
        line = getattr(node, "lineno", 1)
        out.append(Sample(f"summarize:{rel}:{name}", f"Article: {rest}\nSummary:", summary, "summarize",
                          f"docstring of {name} in {rel}:{line} (Python {_pyver()} stdlib)"))
    return out


def _per_file(files: list[Path], candidates: Callable[[Path], list[Sample]], need: int, seed: int) -> list[Sample]:
    """At most one sample per file, files in seeded order: varied and prefix-stable."""
    rng = random.Random(seed)
    out: list[Sample] = []
    for f in files:
        c = candidates(f)
        if c:
            out.append(rng.choice(c))
            if len(out) >= need:
                break
    return out


def _cut(text: str, start: int, n: int) -> tuple[str, int]:
    """text[start:start+n] extended to the end of the word it cuts; -> (piece, end)."""
    end = min(start + n, len(text))
    while end < len(text) and not text[end].isspace():
        end += 1
    return text[start:end], end


def _passage(doc_id: str, text: str, source: str, rng: random.Random) -> Sample | None:
    text = text.replace("\r\n", "\n").replace("\f", "").strip()
    need = TEXT_PROMPT_CHARS + TEXT_REFERENCE_CHARS
    if len(text) < need * 0.8:
        return None
    # start at a paragraph boundary in the first part that leaves room for prompt + reference
    starts = [0] + [m.end() for m in re.finditer(r"\n\s*\n", text) if m.end() <= len(text) - need]
    start = rng.choice(starts)
    prompt, end = _cut(text, start, TEXT_PROMPT_CHARS)
    ref, _ = _cut(text, end, TEXT_REFERENCE_CHARS)
    if len(prompt.strip()) < 200 or len(ref.strip()) < 100:
        return None
    return Sample(f"text:{doc_id}@{start}", prompt, ref, "text", source)


def _docs_python() -> Iterator[tuple[str, str, str]]:
    for k in sorted(topics):
        yield f"pydoc:{k}", topics[k], f"pydoc_data.topics[{k!r}] (Python {_pyver()} language reference)"


def _docs_docstrings(files: list[Path]) -> Iterator[tuple[str, str, str]]:
    for f in files:
        parsed = _parse(f)
        if parsed is None:
            continue
        doc = ast.get_docstring(parsed[1], clean=True)
        if doc and len(doc) >= 800:
            rel = _rel(f)
            yield f"docstring:{rel}", doc, f"module docstring of {rel} (Python {_pyver()} stdlib)"


def license_files() -> list[tuple[str, str]]:
    """(where, text) of license texts found on this machine, deduplicated by content."""
    found: list[tuple[str, Path]] = []
    py_license = stdlib_dir() / "LICENSE.txt"
    if py_license.is_file():
        found.append((f"Python {_pyver()} LICENSE.txt", py_license))
    common = Path("/usr/share/common-licenses")
    if common.is_dir():
        for p in sorted(common.iterdir()):
            if p.is_file() and not p.is_symlink():
                found.append((str(p), p))
    try:
        for dist in md.distributions():
            for f in dist.files or []:
                if re.match(r"(?i)^(licen[cs]e|copying)", f.name):
                    name = dist.metadata.get("Name", "?") if dist.metadata else "?"
                    found.append((f"{name} {f.name} (site-packages)", Path(dist.locate_file(f))))
    except Exception:  # broken metadata must not break the data set
        pass
    seen: set[str] = set()
    out = []
    for where, p in found:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        key = hashlib.sha256(" ".join(text.split()).encode()).hexdigest()
        if key in seen:
            continue
        seen.add(key)
        out.append((key, where, text))
    out.sort()  # by content hash: the order does not depend on paths or install order
    return [(where, text) for _, where, text in out]


def _docs_licenses() -> Iterator[tuple[str, str, str]]:
    for where, text in license_files():
        yield f"license:{hashlib.sha256(text.encode()).hexdigest()[:8]}", text, where


def _text_samples(need: int, seed: int) -> tuple[list[Sample], list[str]]:
    rng = random.Random(seed)

    def shuffled(items):
        items = list(items)
        rng.shuffle(items)
        return iter(items)

    groups = {
        "python-docs": shuffled(_docs_python()),
        "docstrings": _docs_docstrings(_stdlib_files(seed, "text")),  # lazily: parses only what it needs
        "licenses": shuffled(_docs_licenses()),
    }
    out: list[Sample] = []
    used: list[str] = []
    while len(out) < need and groups:
        for name in list(groups):
            if len(out) >= need:
                break
            for doc_id, text, source in groups[name]:
                s = _passage(doc_id, text, source, rng)
                if s is not None:
                    out.append(s)
                    if name not in used:
                        used.append(name)
                    break
            else:
                del groups[name]  # exhausted (or absent on this machine)
    return out, used


def builtin_set(name: str, num_samples: int, seed: int, n_shot: int) -> Dataset:
    need = num_samples + n_shot
    if name == "text":
        samples, used = _text_samples(need, seed)
        desc = "continuation of passages from Python's documentation and license texts on this machine"
        sources = [{"python-docs": "pydoc_data.topics", "docstrings": "stdlib module docstrings",
                    "licenses": "license files (Python, /usr/share/common-licenses, site-packages)"}[u] for u in used]
    else:
        files = _stdlib_files(seed, name)
        if name == "code":
            samples = _per_file(files, _code_candidates, need, seed)
            desc = "standard-library functions: signature + docstring -> body"
        else:
            samples = _per_file(files, _summary_candidates, need, seed)
            desc = "standard-library docstrings: body -> summary line"
        sources = [f"Python {_pyver()} standard library ({stdlib_dir()})"]
    if not samples:
        raise SelfSpecError(f"the built-in '{name}' set found no usable text on this machine (Python sources missing?)")
    if len(samples) < need:
        raise SelfSpecError(f"the built-in '{name}' set has only {len(samples)} prompts here; asked for {need}")
    chosen, pool = samples[:num_samples], samples[num_samples:]
    with_shots(chosen, pool, n_shot, seed, shot_summary if name == "summarize" else shot_plain)
    return Dataset(name, chosen, desc, seed, n_shot, None, sources)
