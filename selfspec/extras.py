"""The optional parts of selfspec and the extra that installs each (pyproject's
optional-dependencies): a missing one is a one-line error naming the pip command that fixes it.

    serve   fastapi, uvicorn, prometheus-client   selfspec serve
    search  optuna                                 selfspec search
    plots   matplotlib                             PNG charts (bench/sweep/search/train reports)
    bench   rouge-score                            ROUGE against references in bench
    train   matplotlib                             training curves
    all     every one of them (scripts/setup.sh installs it)
"""

from __future__ import annotations

import importlib

from selfspec.errors import SelfSpecError

# module -> (its PyPI name, the extra that installs it)
PACKAGES = {
    "fastapi": ("fastapi", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "prometheus_client": ("prometheus-client", "serve"),
    "optuna": ("optuna", "search"),
    "matplotlib": ("matplotlib", "plots"),
    "rouge_score": ("rouge-score", "bench"),
}


def missing(*modules: str) -> list[str]:
    """The modules among `modules` that cannot be imported."""
    gone = []
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError:
            gone.append(mod)
    return gone


def require(what: str, *modules: str) -> None:
    """SelfSpecError (one line) when any of `modules` is missing: `what` needs them, and the
    pip command that installs their extra."""
    gone = missing(*modules)
    if gone:
        raise SelfSpecError(message(what, gone))


def message(what: str, modules: list[str]) -> str:
    names = ", ".join(PACKAGES[m][0] if m in PACKAGES else m for m in modules)
    extras = sorted({PACKAGES[m][1] for m in modules if m in PACKAGES}) or ["all"]
    return f"{what} needs {names}: pip install 'selfspec[{','.join(extras)}]'"


def pyplot():
    """matplotlib.pyplot with the Agg backend (chosen before pyplot loads), or the one-line error."""
    require("plotting", "matplotlib")
    import matplotlib  # the plots extra: only where a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"), see above

    return plt
