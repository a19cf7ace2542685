"""The one exception type users see; the CLI turns it into a single line and exit code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class SelfSpecError(ValueError):
    """Bad input or an unusable model: reported as one line, never as a traceback."""


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """"; did you mean X?" for the closest choice to a mistyped value, else ""."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def unknown_choice(what: str, value: str, choices: Iterable[str]) -> str:
    """The one-line message for a value that is not among `choices`."""
    choices = list(choices)
    return f"unknown {what} {value!r}{did_you_mean(value, choices)} (choose from {', '.join(choices)})"
