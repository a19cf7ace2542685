"""Prompt sets for bench / sweep / correctness, all usable offline.

Built-in sets, cut from real text that ships with every Python installation (plus, for
`text`, license files the OS and installed packages bring along when they exist):

  code       Python standard-library functions: the prompt is the (dedented) decorators,
             signature and docstring, the reference is the real body. Files come from
             `sysconfig.get_paths()["stdlib"]` (tests, idlelib, lib2to3, turtledemo and
             encodings are left out); at most one function per module.
  text       Continuation: a ~1000-character passage as the prompt, the next ~500 characters
             as the reference. Passages rotate over three groups of documents:
               python-docs   the language-reference topics in `pydoc_data.topics`
               docstrings    module docstrings of the standard library (>= 800 characters)
               licenses      Python's LICENSE.txt, /usr/share/common-licenses/*, and the
                             LICENSE/COPYING files of installed distributions (deduplicated
                             by content; the group is skipped when none exist)
  summarize  Summarization-style: a standard-library docstring (module, class or function)
             whose first paragraph is a short summary; the prompt is
             "Article: <rest of the docstring>\\nSummary:", the reference is the summary.

Selection is deterministic for a given seed and Python version (documents are shuffled
with `random.Random(seed)`); the sets differ across Python versions, so every results file
records the set's hash (`Dataset.hash`) and the report warns when compared runs used
different prompts.

Other sources:
  path.jsonl             one JSON object per line: `prompt` (required), `reference`
                         (optional; also read from --reference-field), optional `id` and
                         `task` ("code" turns on the parse check).
  hf:NAME[:config]:split through the `datasets` library (local cache or hub). CNN/DailyMail,
                         XSum and HumanEval get LayerSkip's formats ("Article: ...\\nSummary:",
                         n-shot examples from the train split); any other set reads
                         --prompt-field / --reference-field.

Every source takes LayerSkip's `--template` (a string containing `{message}`, applied to
the final prompt) and `--n-shot` (examples with their references prepended).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from selfspec.errors import SelfSpecError, did_you_mean

BUILTIN = ("code", "text", "summarize")
_EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "encodings", "site-packages",
                  "dist-packages", "__pycache__", "ensurepip", "pydoc_data", "__phello__"}
TEXT_PROMPT_CHARS = 1000
TEXT_REFERENCE_CHARS = 500
CODE_MAX_PROMPT_CHARS = 1500
SUMMARY_MAX_ARTICLE_CHARS = 2500


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


# ---- entry point ---------------------------------------------------------------------------


def load_dataset(
    spec: str,
    num_samples: int,
    seed: int = 0,
    *,
    n_shot: int = 0,
    template: str | None = None,
    prompt_field: str = "prompt",
    reference_field: str | None = None,
) -> Dataset:
    """`spec`: code | text | summarize | path.jsonl | hf:NAME[:config]:split."""
    if not isinstance(num_samples, int) or num_samples < 1:
        raise SelfSpecError(f"--num-samples must be a positive integer, got {num_samples}")
    if n_shot < 0:
        raise SelfSpecError(f"--n-shot must be >= 0, got {n_shot}")
    if template is not None and "{message}" not in template:
        raise SelfSpecError("--template must contain {message} where the prompt goes, e.g. '[INST] {message} [/INST]'")
    if spec in BUILTIN:
        ds = _builtin(spec, num_samples, seed, n_shot)
    elif spec.startswith("hf:"):
        ds = _hf(spec, num_samples, seed, n_shot, prompt_field, reference_field)
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            raise SelfSpecError(f"--dataset {spec} is a directory; give a .jsonl file")
        if not path.is_file():
            if path.suffix or "/" in spec or os.sep in spec:  # meant as a file
                raise SelfSpecError(f"dataset file not found: {spec}")
            raise SelfSpecError(f"unknown dataset {spec!r}{did_you_mean(spec, BUILTIN)} (choose {', '.join(BUILTIN)}, "
                                "a .jsonl file, or hf:NAME[:config]:split)")
        ds = _jsonl(path, num_samples, seed, n_shot, prompt_field, reference_field or "reference")
    if template is not None:
        for s in ds.samples:
            s.prompt = template.replace("{message}", s.prompt)
        ds.template = template
    return ds


def _with_shots(chosen: list[Sample], pool: list[Sample], n_shot: int, seed: int, fmt: Callable[[Sample], str]) -> None:
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


def _shot_plain(s: Sample) -> str:
    return s.prompt + (s.reference or "") + "\n\n"


def _shot_summary(s: Sample) -> str:  # LayerSkip: "Article: ...\nSummary: <one line>\n", then a blank line
    return s.prompt + " " + (s.reference or "").replace("\n", " ") + "\n\n"


# ---- built-in sets -------------------------------------------------------------------------


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
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
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
        import importlib.metadata as md

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


def _builtin(name: str, num_samples: int, seed: int, n_shot: int) -> Dataset:
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
    _with_shots(chosen, pool, n_shot, seed, _shot_summary if name == "summarize" else _shot_plain)
    return Dataset(name, chosen, desc, seed, n_shot, None, sources)


# ---- JSONL -------------------------------------------------------------------------------


def _jsonl(path: Path, num_samples: int, seed: int, n_shot: int, prompt_field: str, reference_field: str) -> Dataset:
    rows: list[Sample] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SelfSpecError(f"cannot read {path}: {e}") from e
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise SelfSpecError(f"{path}:{i}: not valid JSON ({e.msg})") from e
        if not isinstance(d, dict) or not isinstance(d.get(prompt_field), str) or not d[prompt_field].strip():
            raise SelfSpecError(f"{path}:{i}: each line needs a non-empty string field {prompt_field!r}")
        ref = d.get(reference_field)
        if ref is not None and not isinstance(ref, str):
            raise SelfSpecError(f"{path}:{i}: {reference_field!r} must be a string")
        task = d.get("task", "custom")
        rows.append(Sample(str(d.get("id", f"{path.name}:{i}")), d[prompt_field], ref, str(task), f"{path}:{i}"))
    if not rows:
        raise SelfSpecError(f"{path} has no prompts")
    chosen, pool = _select(rows, num_samples, n_shot, seed, str(path))
    _with_shots(chosen, pool, n_shot, seed, _shot_plain)
    return Dataset(str(path), chosen, f"prompts from {path}", seed, n_shot, None, [str(path.resolve())])


def _select(rows: list, num_samples: int, n_shot: int, seed: int, what: str) -> tuple[list, list]:
    """All rows in file order when there are few enough; else a seeded subset kept in order.
    The rows not chosen are the pool for n-shot examples."""
    if n_shot and len(rows) <= n_shot:
        raise SelfSpecError(f"{what}: {len(rows)} rows cannot give {n_shot} shots plus prompts")
    n = min(num_samples, len(rows) - n_shot)
    idx = sorted(random.Random(seed).sample(range(len(rows)), n)) if n < len(rows) else list(range(len(rows)))
    chosen_set = set(idx)
    return [rows[i] for i in idx], [r for i, r in enumerate(rows) if i not in chosen_set]


# ---- Hugging Face datasets -----------------------------------------------------------------

# basename of the hub id -> (task, prompt field, reference field, default config)
_HF_FORMATS = {
    "cnn_dailymail": ("summarize", "article", "highlights", "3.0.0"),
    "xsum": ("summarize", "document", "summary", None),
    "openai_humaneval": ("code", "prompt", "canonical_solution", None),
    "humaneval": ("code", "prompt", "canonical_solution", None),
}


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    parts = spec[3:].split(":")
    if len(parts) == 2 and all(parts):
        return parts[0], None, parts[1]
    if len(parts) == 3 and parts[0] and parts[2]:
        return parts[0], parts[1] or None, parts[2]
    raise SelfSpecError(f"bad dataset {spec!r}: expected hf:NAME[:config]:split, e.g. hf:cnn_dailymail:3.0.0:test")


def _hf_load(name: str, config: str | None, split: str):
    try:
        import datasets
    except ImportError as e:
        raise SelfSpecError("hf: data sets need the `datasets` package (pip install datasets)") from e
    try:
        return datasets.load_dataset(name, config, split=split) if config else datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, unknown name, missing config/split: many exception types
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SelfSpecError(
            f"cannot load hf:{name}{':' + config if config else ''}:{split} ({msg}); it needs a local copy in the "
            "datasets cache or a connection to the hub (HF_DATASETS_OFFLINE=1 forces the cache)"
        ) from e


def _hf(spec: str, num_samples: int, seed: int, n_shot: int, prompt_field: str, reference_field: str | None) -> Dataset:
    name, config, split = parse_hf_spec(spec)
    base = name.rsplit("/", 1)[-1].lower()
    fmt = _HF_FORMATS.get(base)
    if fmt is not None:
        task, pf, rf, default_config = fmt
        config = config or default_config
    else:
        task, pf, rf = "custom", prompt_field, reference_field
    data = _hf_load(name, config, split)
    columns = set(getattr(data, "column_names", None) or (data[0].keys() if len(data) else ()))
    if pf not in columns:
        raise SelfSpecError(f"hf:{name} has no field {pf!r} (fields: {', '.join(sorted(columns))}); use --prompt-field")
    if rf is not None and rf not in columns:
        raise SelfSpecError(f"hf:{name} has no field {rf!r} (fields: {', '.join(sorted(columns))}); use --reference-field")

    def sample(i: int, row: dict, sp: str) -> Sample:
        text = row[pf]
        prompt = f"Article: {text}\nSummary:" if task == "summarize" else text
        return Sample(str(row.get("task_id", row.get("id", f"{sp}:{i}"))), prompt, row.get(rf) if rf else None,
                      task, f"hf:{name}{':' + config if config else ''}:{sp}[{i}]")

    n = len(data)
    idx = sorted(random.Random(seed).sample(range(n), min(num_samples, n)))
    chosen = [sample(i, data[i], split) for i in idx]
    pool: list[Sample] = []
    if n_shot:
        # LayerSkip draws the shots from the train split; a set without one uses unchosen rows
        shots_split = "train" if split != "train" else split
        try:
            shot_data = _hf_load(name, config, shots_split) if shots_split != split else data
        except SelfSpecError:
            shot_data = data
        taken = set(idx) if shot_data is data else set()
        cand = [i for i in range(len(shot_data)) if i not in taken]
        for i in random.Random(seed + 1).sample(cand, min(len(cand), max(n_shot * 4, n_shot))):
            pool.append(sample(i, shot_data[i], shots_split))
    _with_shots(chosen, pool, n_shot, seed, _shot_summary if task == "summarize" else _shot_plain)
    return Dataset(spec, chosen, f"Hugging Face dataset {name} ({config or 'default'}, {split})", seed, n_shot, None, [spec])
