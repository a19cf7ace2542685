"""Issue 54.6: the optional parts are extras; a missing one is one line naming its pip command."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from selfspec import extras
from selfspec.errors import SelfSpecError
from selfspec.search.study import _optuna
from selfspec.server.cli import _check_deps
from selfspec.tools.quality import rouge

ROOT = Path(__file__).resolve().parent.parent


def _gone(monkeypatch, *modules):
    for m in modules:  # None in sys.modules: `import m` raises ImportError
        monkeypatch.setitem(sys.modules, m, None)


@pytest.mark.parametrize("call, modules, extra", [
    (lambda: _check_deps(False), ("uvicorn",), "serve"),
    (lambda: _check_deps(False), ("fastapi", "prometheus_client"), "serve"),
    (_optuna, ("optuna",), "search"),
    (extras.pyplot, ("matplotlib",), "plots"),
    (lambda: rouge("a b", "a b"), ("rouge_score",), "bench"),
])
def test_a_missing_extra_is_one_line_naming_its_install(monkeypatch, call, modules, extra):
    _gone(monkeypatch, *modules)
    monkeypatch.setattr("selfspec.tools.quality._scorer", None)
    with pytest.raises(SelfSpecError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and f"pip install 'selfspec[{extra}]'" in msg, msg
    for m in modules:
        assert extras.PACKAGES[m][0] in msg


def test_every_extra_package_is_declared_in_its_extra():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = meta["optional-dependencies"]
    core = " ".join(meta["dependencies"])
    for module, (package, extra) in extras.PACKAGES.items():
        assert any(d.startswith(package) for d in declared[extra]), (module, extra)
        assert package not in core, f"{package} is optional: not a core dependency"
        assert extra in declared["all"][0]
