"""Issue 54.5: the README is a first screen, the rest is a site built from docs/.

- `mkdocs build --strict` succeeds: a broken link between pages, a link to an anchor that does
  not exist, or a page missing from the nav is a warning, and strict makes it a failure;
- every relative link in README.md points to a file of the repository;
- the README stays under 250 lines, and its first commands are the ones CI runs (.ci/run);
- docs/layout.md names every module and package of selfspec/, and nothing that is not there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml  # mkdocs' own dependency (pyyaml)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def test_the_site_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                        "--config-file", str(ROOT / "mkdocs.yml")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_the_nav_lists_every_page():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    assert config["strict"] == "true"
    listed = {next(iter(entry.values())) for entry in config["nav"]}
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert listed == pages


def test_readme_links_point_to_files():
    broken = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the README itself
        if not (ROOT / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, broken


def test_readme_is_a_first_screen_with_the_ci_commands():
    text = README.read_text()
    assert len(text.splitlines()) < 250
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert first == ['./scripts/setup.sh && .venv/bin/selfspec generate "def fibonacci(n):" --max-new-tokens 64 '
                     "--stream-style speculative",
                     ".venv/bin/python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/setup.sh" in ci and ".venv/bin/python -m pytest" in ci


def test_layout_page_names_every_module():
    """The package's list names every module and package, and nothing that is not there; the
    benchmarks' list names only folders and scripts that exist."""
    text = (DOCS / "layout.md").read_text()
    package_part, bench_part = text.split("\nTests are in", 1)
    named = set(re.findall(r"^- `([\w/.]+)`", package_part, re.M))
    package = ROOT / "selfspec"
    present = {p.name + "/" if p.is_dir() else p.name for p in package.iterdir()
               if p.suffix == ".py" and p.stem not in ("__init__", "__main__") or (p / "__init__.py").exists()}
    assert not present - named, f"modules missing from docs/layout.md: {sorted(present - named)}"
    assert not named - present, f"docs/layout.md names what is not there: {sorted(named - present)}"
    folders = re.findall(r"^- `(\w+)/`(.*(?:\n  .*)*)", bench_part, re.M)
    assert folders
    for folder, line in folders:
        for script in re.findall(r"`(\w+\.(?:py|json))`", line):
            assert (ROOT / "benchmarks" / folder / script).exists(), f"benchmarks/{folder}/{script}"


def test_paths_named_in_the_docs_exist():
    """A script, test or source file the README or a page names (`benchmarks/speed/vs_llamacpp.py`,
    `selfspec/csrc/gemm.c`...) is there: a move updates the docs with it."""
    path = re.compile(r"\b(?:benchmarks|examples|tests|selfspec|scripts)/[\w./-]+\.(?:py|json|md|c|h|sh)\b")
    missing = set()
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for p in path.findall(page.read_text()):
            if not re.search(r"/[A-Z]+[/.]", p) and not (ROOT / p).exists():  # SUBJECT/NAME: a placeholder
                missing.add(f"{page.name}: {p}")
    assert not missing, sorted(missing)
