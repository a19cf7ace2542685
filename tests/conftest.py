"""Fixtures shared by the whole suite.

* Tiny random-weight models of every supported architecture (built once per session).
* The real default model (`gemma-3-270m`), loaded ONCE per session (float32, and bfloat16
  for the bf16 tests), for tests marked slow.
* Measured costs (auto's cost model) go to a temporary directory, never the user's cache:
  no run sees timings another run measured.
* A call of SelfSpecModel.generate from a test must name its strategy (strategy=, draft= or
  profile=): the default, auto, drafts, so a reference that silently relied on it would
  compare speculative decoding with itself. References use helpers.ar_generate.

Torch runs single-threaded here: the tiny models are far too small to gain from threads,
and on a busy 2-core CI box spinning thread pools make multi-threaded tiny matmuls ~100x
slower. SELFSPEC_TEST_THREADS overrides it (the real-model tests use it too).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import helpers  # noqa: E402

torch.set_num_threads(int(os.environ.get("SELFSPEC_TEST_THREADS", "1")))
warnings.filterwarnings("ignore", message=".*generation flags.*")


class _TinyZoo:
    """Caches (hf_model, selfspec_model) pairs by their build arguments."""

    def __init__(self):
        self._cache: dict = {}

    def get(self, arch: str, seed: int = 0, dtype: str = "float32", **config_kw):
        key = (arch, seed, dtype, tuple(sorted(config_kw.items())))
        if key not in self._cache:
            self._cache[key] = helpers.load_tiny(arch, seed=seed, dtype=dtype, **config_kw)
        return self._cache[key]


@pytest.fixture(scope="session")
def zoo() -> _TinyZoo:
    return _TinyZoo()


@pytest.fixture(scope="session")
def draft_model_dir(tmp_path_factory):
    """A second tiny model (2 layers, same vocabulary) saved as a HF directory."""
    d = tmp_path_factory.mktemp("draft-model")
    helpers.build_hf("llama", seed=5, num_layers=2).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def default_model():
    """The real Gemma 3 270M in float32 (converted from the GGUF package on first use)."""
    import selfspec

    return selfspec.load("gemma-3-270m", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def default_model_bf16():
    """The real Gemma 3 270M in bfloat16 (what users run on the CPU: the fused kernels where
    they build)."""
    import selfspec

    return selfspec.load("gemma-3-270m", dtype="bfloat16", device="cpu")


@pytest.fixture(scope="session", autouse=True)
def _private_cost_cache(tmp_path_factory):
    """Measured costs and quantized copies in fresh directories for this session (subprocesses
    inherit them). Only those: the rest of the selfspec cache holds the converted default
    model (1.1 GB)."""
    saved = {k: os.environ.get(k) for k in ("SELFSPEC_COSTS_DIR", "SELFSPEC_QUANT_DIR")}
    os.environ["SELFSPEC_COSTS_DIR"] = str(tmp_path_factory.mktemp("costs"))
    os.environ["SELFSPEC_QUANT_DIR"] = str(tmp_path_factory.mktemp("quantized"))  # quantized copies, likewise
    yield
    for k, old in saved.items():
        if old is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = old


TESTS = Path(__file__).resolve().parent
DEFAULT_STRATEGY_ALLOWED: frozenset[str] = frozenset()  # test files exempt from the rule (none)


def strategy_named(kw: dict) -> bool:
    return any(kw.get(k) is not None for k in ("strategy", "draft", "profile"))


@pytest.fixture(scope="session", autouse=True)
def _strategy_must_be_named():
    from selfspec.model import SelfSpecModel

    plain = SelfSpecModel.generate

    @functools.wraps(plain)
    def generate(self, prompt, **kw):
        if not strategy_named(kw):
            caller = sys._getframe(1)
            path = Path(caller.f_code.co_filename).resolve()
            if path.parent == TESTS and path.name not in DEFAULT_STRATEGY_ALLOWED:
                raise AssertionError(f"{path.name}:{caller.f_lineno}: generate() without a strategy runs auto, which drafts; "
                                     "name the strategy (a reference: helpers.ar_generate)")
        return plain(self, prompt, **kw)

    SelfSpecModel.generate = generate
    yield
    SelfSpecModel.generate = plain
