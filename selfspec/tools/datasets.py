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
  hf:NAME[:config]:split through the `datasets` library, from its local cache only (never the hub). CNN/DailyMail,
                         XSum and HumanEval get LayerSkip's formats ("Article: ...\\nSummary:",
                         n-shot examples from the train split); any other set reads
                         --prompt-field / --reference-field.

Every source takes LayerSkip's `--template` (a string containing `{message}`, applied to
the final prompt) and `--n-shot` (examples with their references prepended).
"""


from __future__ import annotations

import json
import os
import random
from pathlib import Path

from selfspec.errors import SelfSpecError, did_you_mean
from selfspec.tools.builtin_sets import BUILTIN, builtin_set
from selfspec.tools.samples import Dataset, Sample, shot_plain, shot_summary, with_shots

__all__ = ["BUILTIN", "Dataset", "Sample", "load_dataset", "parse_hf_spec"]


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
        ds = builtin_set(spec, num_samples, seed, n_shot)
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
    with_shots(chosen, pool, n_shot, seed, shot_plain)
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


def hf_load(name: str, config: str | None, split: str):
    """A `datasets` split from the local cache (never the hub); a one-line SelfSpecError otherwise."""
    # Nothing downloads from a hub at run time: `datasets` reads these when it is imported.
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import datasets  # optional (the datasets extra): only hf: sets need it
    except ImportError as e:
        raise SelfSpecError("hf: data sets need the `datasets` package (pip install datasets)") from e
    cfg = getattr(datasets, "config", None)
    if cfg is not None and not (getattr(cfg, "HF_HUB_OFFLINE", False) or getattr(cfg, "HF_DATASETS_OFFLINE", False)):
        raise SelfSpecError("hf: data sets are read from the local datasets cache only, but `datasets` was imported "
                            "online before selfspec; set HF_HUB_OFFLINE=1 before starting")
    try:
        return datasets.load_dataset(name, config, split=split) if config else datasets.load_dataset(name, split=split)
    except Exception as e:  # offline, unknown name, missing config/split: many exception types
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SelfSpecError(
            f"cannot load hf:{name}{':' + config if config else ''}:{split} ({msg}); it is read from the local "
            "datasets cache only, never downloaded from the hub: put a copy there first"
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
    data = hf_load(name, config, split)
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
            shot_data = hf_load(name, config, shots_split) if shots_split != split else data
        except SelfSpecError:
            shot_data = data
        taken = set(idx) if shot_data is data else set()
        cand = [i for i in range(len(shot_data)) if i not in taken]
        for i in random.Random(seed + 1).sample(cand, min(len(cand), max(n_shot * 4, n_shot))):
            pool.append(sample(i, shot_data[i], shots_split))
    with_shots(chosen, pool, n_shot, seed, shot_summary if task == "summarize" else shot_plain)
    return Dataset(spec, chosen, f"Hugging Face dataset {name} ({config or 'default'}, {split})", seed, n_shot, None, [spec])
