"""The strategy registry: one entry per draft strategy, everything the library asks of it by name.

    Strategy(name, options, build, required, batching, self_drafting, checks_guesses,
             exit_states, needs_kernels)

DraftConfig validates a configuration against its entry (the options it reads, config.py),
drafters/factory.build makes a generation's drafter with `build`, the batch engine drives it
by `batching` (batch/sequence.py), the CLI lists the names and requires `required`. The
built-in strategies are registered by selfspec/drafters/strategies.py, which the drafters
package imports, so every entry is in place once `selfspec` is imported. Adding a strategy
is one module: its Drafter subclass and one `register(Strategy(...))` (tests/test_registry.py
does it).

This module sits below config.py and imports nothing of the library but its errors: an entry's
`build` receives the configuration and the model's resources, and only calls into them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from selfspec.errors import SelfSpecError, unknown_choice

if TYPE_CHECKING:
    from selfspec.config import DraftConfig
    from selfspec.drafters.base import Drafter
    from selfspec.resources import DraftResources

# How the batch engine drives a strategy's drafter (batch/sequence.py's module doc):
#   plain  no drafts (autoregressive)
#   free   drafts cost no forward pass (a list scan), made per sequence; verified in the batch
#   depth  self-drafts over the model's own layers: sequences with the same depth_signature()
#          draft in one batched call per draft step (batch/passes.draft_depth)
#   solo   the drafter runs its own forward passes, interleaved with the batch
BATCHINGS = ("plain", "free", "depth", "solo")

# (cfg, resources, eos ids, vocab: whether to set cfg.draft_vocab here) -> a new drafter for one generation
Build = Callable[["DraftConfig", "DraftResources", tuple[int, ...], bool], "Drafter"]


@dataclass(frozen=True)
class Strategy:
    name: str
    options: frozenset[str]  # the DraftConfig fields it reads besides `strategy`; any other must keep its default
    build: Build
    required: tuple[str, ...] = ()  # it cannot run without one of these options when nothing (a profile) supplies them
    batching: str = "solo"  # BATCHINGS
    self_drafting: bool = False  # drafts with the model's own weights: lookup_first may put prompt lookup first
    checks_guesses: bool = False  # lookup-first's copies are guesses of its own draft (LayerSkipDrafter.draft_guessed)
    exit_states: bool = False  # batched verification enters at its exit layer with the drafts' exit hidden states
    needs_kernels: bool = False  # drafts only where selfspec's CPU kernels run (at load: factory.runs_here)

    def __post_init__(self):
        if self.batching not in BATCHINGS:
            raise SelfSpecError(unknown_choice("batching", self.batching, BATCHINGS))
        object.__setattr__(self, "options", frozenset(self.options))


_entries: dict[str, Strategy] = {}


def register(entry: Strategy, replace: bool = False) -> Strategy:
    """Add a strategy (replace=True: over one of the same name); -> the entry."""
    if entry.name in _entries and not replace:
        raise SelfSpecError(f"a strategy named {entry.name!r} is registered already")
    _entries[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a strategy (a test's own, for one)."""
    _entries.pop(name, None)


def strategy(name: Any) -> Strategy:
    """The entry of `name`; a SelfSpecError naming the choices when there is none."""
    try:
        return _entries[name]
    except (KeyError, TypeError):
        raise SelfSpecError(unknown_choice("strategy", name, names())) from None


def names() -> tuple[str, ...]:
    """Every registered strategy, in the order registered."""
    return tuple(_entries)


def known(name: Any) -> bool:
    return isinstance(name, str) and name in _entries
