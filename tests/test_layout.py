"""The package's shape, checked from its source with `ast` (nothing is imported):

- no import cycles among selfspec modules (module-level imports; `if TYPE_CHECKING:` blocks
  do not count);
- direction: the core library (everything but the layers in UPPER) imports none of those
  layers: tools, search, server, training and the CLI sit above it;
- no imports inside functions, except of the optional packages in OPTIONAL, each with a
  comment saying why (on its line or the line above);
- no module over MAX_MODULE_LINES lines and no function over MAX_FUNCTION_LINES lines,
  except the entries of EXEMPT, each with its reason.

Exemptions that are no longer needed fail too, so the lists only shrink.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "selfspec"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80

# module (or package prefix) -> why it is imported inside the function that needs it
OPTIONAL = {
    "ray": "the ray extra (selfspec serve --ray)",
    "uvicorn": "the HTTP server: only `selfspec serve` needs it, not every command's start",
    "selfspec.server.routes": "imports fastapi and prometheus-client (~0.5 s): only `selfspec serve` needs them",
    "selfspec.server.app": "the routes' old import path (as selfspec.server.routes)",
    "optuna": "~1 s to import; only a search needs it, and every command's parser loads search/cli.py",
    "datasets": "the datasets extra (hf: prompt sets and training data)",
    "matplotlib": "plotting only; the Agg backend must be chosen before pyplot loads",
    "llama_cpp": "llama.cpp comparisons in benchmarks only",
    "psutil": "not a dependency; memory numbers use it only where /proc is missing",
    "rouge_score": "~2 s to import (nltk); only bench runs with references need it",
    "transformers.models": "the loaded architecture's own modeling module; importing all of them costs seconds per start",
}


def _optional(module: str) -> bool:
    return any(module == o or module.startswith(o + ".") for o in OPTIONAL)


# the layers above the core library: the core imports none of them (a tool may import the core)
UPPER = ("selfspec.tools", "selfspec.search", "selfspec.server", "selfspec.training", "selfspec.cli_args", "selfspec.cli",
         "selfspec.__main__")


def _upper(name: str) -> bool:
    return any(name == u or name.startswith(u + ".") for u in UPPER)

# "path" (module lines) or "path:qualname" (function lines) -> why it may be longer
EXEMPT: dict[str, str] = {}

# "path" -> why it still imports non-optional packages inside functions
LAZY_IMPORTS_EXEMPT: dict[str, str] = {}


@dataclass
class Module:
    name: str  # dotted
    path: str  # relative to the repository, with "/"
    tree: ast.Module
    lines: list[str]
    is_package: bool
    imports: set[str] = field(default_factory=set)  # selfspec modules imported at module level


def _modules(root: Path = PACKAGE) -> dict[str, Module]:
    mods = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        text = p.read_text()
        rel = p.relative_to(root.parent).as_posix()
        mods[name] = Module(name, rel, ast.parse(text, rel), text.splitlines(), is_package)
    for m in mods.values():
        m.imports = {t for t in _module_level_targets(m, mods) if t != m.name}
    return mods


def _targets(node: ast.Import | ast.ImportFrom, mod: Module, mods: dict[str, Module]) -> list[str]:
    """The selfspec modules an import statement loads (the innermost one that exists)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = mod.name.split(".")[: len(mod.name.split(".")) - node.level + (1 if mod.is_package else 0)]
            full = ".".join(base + ([node.module] if node.module else []))
        else:
            full = node.module or ""
        names = [f"{full}.{a.name}" if f"{full}.{a.name}" in mods else full for a in node.names]
    out = []
    for n in names:
        while n and n not in mods:
            n = n.rpartition(".")[0]
        if n:
            out.append(n)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _module_level_targets(mod: Module, mods: dict[str, Module]) -> list[str]:
    out = []

    def visit(stmts):
        for s in stmts:
            if isinstance(s, (ast.Import, ast.ImportFrom)):
                out.extend(_targets(s, mod, mods))
            elif isinstance(s, ast.If) and not _is_type_checking(s):
                visit(s.body)
                visit(s.orelse)
            elif isinstance(s, ast.Try):
                visit(s.body)
                for h in s.handlers:
                    visit(h.body)
                visit(s.orelse)
                visit(s.finalbody)

    visit(mod.tree.body)
    return out


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualname, node) of every function, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            q = prefix + node.name
            yield q, node
            yield from _functions(node, q + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def find_cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(mods[v].imports):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(mods):
        if v not in index:
            connect(v)
    return cycles


def back_arrows(mods: dict[str, Module]) -> list[str]:
    """Core modules that import an upper layer (module-level imports, or any inside functions)."""
    bad = []
    for m in mods.values():
        if _upper(m.name) or m.name == "selfspec":
            continue
        inner = [t for node in ast.walk(m.tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for t in _targets(node, m, mods)]
        bad += [f"{m.name} -> {t}" for t in sorted(m.imports | set(inner)) if _upper(t)]
    return bad


def function_imports(mods: dict[str, Module]) -> list[str]:
    """Imports inside functions that are not allowed: not optional, or without a comment."""
    bad = []
    for m in mods.values():
        for q, fn in _functions(m.tree):
            for node in ast.walk(fn):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                where = f"{m.path}:{node.lineno} ({q}): {ast.unparse(node)}"
                if m.path in LAZY_IMPORTS_EXEMPT:
                    continue
                if not all(_optional(x) for x in _imported(node)):
                    bad.append(where)
                elif not any("#" in m.lines[i] for i in (node.lineno - 2, node.lineno - 1) if i >= 0):
                    bad.append(where + "  [no comment saying why]")
    return bad


def oversized(mods: dict[str, Module]) -> tuple[list[str], set[str]]:
    """(violations, exemptions used)."""
    bad, used = [], set()
    for m in mods.values():
        if len(m.lines) > MAX_MODULE_LINES:
            (used.add(m.path) if m.path in EXEMPT else bad.append(f"{m.path}: {len(m.lines)} lines"))
        for q, fn in _functions(m.tree):  # a nested function's lines count in its parent's too
            key, n = f"{m.path}:{q}", fn.end_lineno - fn.lineno + 1
            if n > MAX_FUNCTION_LINES:
                (used.add(key) if key in EXEMPT else bad.append(f"{key}: {n} lines"))
    return bad, used


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return ["." if node.level else node.module or ""]


def _lazy_exempt_used(mods: dict[str, Module]) -> set[str]:
    """Exempt files that still import something inside a function that the rules forbid."""
    used = set()
    for m in mods.values():
        for _, fn in _functions(m.tree):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not all(_optional(x) for x in _imported(node)):
                    used.add(m.path)
    return used & set(LAZY_IMPORTS_EXEMPT)


# ---- the tests ----------------------------------------------------------------------------------


def test_no_import_cycles():
    cycles = find_cycles(_modules())
    assert not cycles, "import cycles among selfspec modules (module-level imports):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_core_imports_no_upper_layer():
    bad = back_arrows(_modules())
    assert not bad, "the core library imports a layer above it (move what it needs below it):\n" + "\n".join(bad)


def test_no_function_level_imports_but_optional_ones():
    bad = function_imports(_modules())
    assert not bad, (f"imports inside functions (allowed only for {sorted(OPTIONAL)}, with a comment saying why; "
                     "import everything else at the top of the module):\n" + "\n".join(bad))


def test_module_and_function_sizes():
    bad, _ = oversized(_modules())
    assert not bad, (f"over {MAX_MODULE_LINES} lines per module / {MAX_FUNCTION_LINES} per function "
                     "(split it, or add it to EXEMPT in tests/test_layout.py with the reason):\n" + "\n".join(bad))


def test_exemptions_are_still_needed():
    mods = _modules()
    _, used = oversized(mods)
    stale = sorted(set(EXEMPT) - used) + sorted(set(LAZY_IMPORTS_EXEMPT) - _lazy_exempt_used(mods))
    assert not stale, "exemptions no longer needed (remove them from tests/test_layout.py):\n" + "\n".join(stale)
    assert all(isinstance(r, str) and r for r in {**EXEMPT, **LAZY_IMPORTS_EXEMPT}.values())


def test_the_checks_catch_violations(tmp_path):
    """Each check fires on a package that breaks it."""
    pkg = tmp_path / "selfspec"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("from selfspec.sub import b\n\n\ndef f():\n    import json\n    import ray\n    # plots only\n    import matplotlib\n")
    (pkg / "sub" / "b.py").write_text("import selfspec.a\n" + "x = 1\n" * MAX_MODULE_LINES)
    (pkg / "c.py").write_text("def g():\n" + "    pass\n" * MAX_FUNCTION_LINES)
    (pkg / "tools").mkdir()
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "tools" / "t.py").write_text("from selfspec import a\n")
    (pkg / "d.py").write_text("from selfspec.tools import t\n")
    mods = _modules(pkg)
    assert back_arrows(mods) == ["selfspec.d -> selfspec.tools.t"]
    assert find_cycles(mods) == [["selfspec.a", "selfspec.sub.b"]]
    bad = function_imports(mods)
    assert len(bad) == 2 and "import json" in bad[0] and "import ray" in bad[1] and "no comment" in bad[1]
    sizes, _ = oversized(mods)
    assert sorted(sizes) == ["selfspec/c.py:g: 81 lines", "selfspec/sub/b.py: 451 lines"]
