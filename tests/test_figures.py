"""Issue 54.5: numbers measured on some day belong in benchmarks/RESULTS.md (with the command and
the machine) or the docs, not in the code. A comment or docstring in selfspec/ may say why the
code is as it is, without the figure: no throughput (tok/s, GB/s), no timing (ms, us, ~N s), no
speed ratio (1.8x faster, 0.94-1.0x plain decoding). Ratios of sizes (0.5x the bf16 bytes) and
rules (at most 4x, more than 2x this many tokens) are not measurements and stay.

Strings that are values (a help text, a table's caption) are not scanned: only comments and
docstrings (string statements).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "selfspec"

NUMBER = r"\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?"
FIGURES = [
    ("throughput", re.compile(rf"{NUMBER}\s*(?:tok(?:ens)?/s|GB/s|MB/s)")),
    ("timing", re.compile(rf"(?<!every )(?<![\w.]){NUMBER}\s*(?:ms|us|µs)\b")),
    ("seconds", re.compile(rf"~\s*{NUMBER}\s*(?:s|min)\b")),
    ("speed ratio", re.compile(rf"(?<![\w.]){NUMBER}x(?![\w])")),
]
# a ratio on a line that speaks of sizes or states a rule is not a measured speed
NOT_A_SPEED = re.compile(r"bytes|this many|at most|by \d+x|\bthe bf16\b")


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a file."""
    text = path.read_text()
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i, line in enumerate(text.splitlines()[node.lineno - 1:node.end_lineno]):
                out.append((node.lineno + i, line))
    return sorted(set(out))


def figures_in(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    found = []
    for lineno, line in _prose_lines(path):
        for kind, pattern in FIGURES:
            m = pattern.search(line)
            if m and not (kind == "speed ratio" and NOT_A_SPEED.search(line)):
                found.append(f"{path.relative_to(root)}:{lineno}: {kind} {m.group(0)!r}: {line.strip()}")
                break
    return found


def test_the_scanner_sees_figures(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Fast: 238 tok/s on the reference machine."""\n'
                 "x = 1  # 0.83 ms a row at 64 rows\n"
                 "def g():\n    '''auto 1.03x end to end; made in ~1 s.'''\n"
                 "y = 'a value: 3 ms'  # the int8 copy is 0.5x the bf16 bytes; sampled every 10 ms\n")
    found = figures_in(f, tmp_path)
    assert [line.split(":")[1] for line in found] == ["1", "2", "4"], found
    assert [line.split(": ")[1].split(" '")[0] for line in found] == ["throughput", "timing", "seconds"], found


def test_no_measured_figures_in_comments_or_docstrings():
    found = [f for p in sorted(PACKAGE.rglob("*.py")) for f in figures_in(p)]
    assert not found, "measured figures in selfspec/ (move them to benchmarks/RESULTS.md or the docs, keep the reason):\n" \
        + "\n".join(found)
