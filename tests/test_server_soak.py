"""A short soak of `selfspec serve` (benchmarks/server/soak.py with a few dozen requests on a tiny
model): concurrent streaming clients, clients leaving mid-stream, malformed and oversized
bodies, wrong keys. No 5xx, every output equal to direct generation, no leaked slot, no
traceback, and /health's outcomes agree with the statuses the clients saw."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("openai")
pytest.importorskip("psutil")

import selfspec  # noqa: E402

from test_server import build_tiny_model  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "server" / "soak.py"


def load_soak():
    spec = importlib.util.spec_from_file_location("selfspec_soak", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    sys.path.insert(0, str(BENCH.parent))  # its sibling server_load.py (it puts benchmarks/ on the path itself)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH.parent))
    return mod


def test_short_soak(tmp_path):
    soak = load_soak()
    tiny = build_tiny_model(tmp_path / "model")
    model = selfspec.load(str(tiny), dtype="float32", device="cpu")
    report = soak.run(model, str(tiny), ["--dtype", "float32", "--device", "cpu", "--threads", "1", "--strategy", "early-exit",
                                         "--exit-layer", "2", "--max-concurrency", "16"],
                      n=48, clients=6, max_tokens=12, seed=3, log_path=tmp_path / "server.log")
    assert report["requests"] == 48
    assert report["5xx"] == 0 and report["unexpected_status"] == 0, report["by_kind"]
    assert report["outputs_compared"] > 0 and report["outputs_equal"] == report["outputs_compared"]
    assert report["leaked_slots"] == 0
    assert report["server_tracebacks"] == 0
    kinds = {k: v["requests"] for k, v in report["by_kind"].items()}
    assert all(kinds[k] > 0 for k in ("stream", "leave", "malformed", "bad_key")), kinds
    # the statuses /health counted (warm-up round included) are the ones the clients could see
    assert set(report["health_outcomes"]) <= {"200", "400", "401", "413", "499"}, report["health_outcomes"]


@pytest.mark.parametrize("counts", ["0", "a,1", "1,100"])
def test_server_load_rejects_bad_hf_clients(counts):
    """benchmarks/server/server_load.py: a request count outside 1..64 is a usage error (exit 2), not a
    division by zero after minutes of measuring."""
    import subprocess
    bench = BENCH.parent / "server_load.py"
    r = subprocess.run([sys.executable, str(bench), "--sweep", "--hf-clients", counts], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--hf-clients must be request counts" in r.stderr and "Traceback" not in r.stderr


def test_server_load_keeps_a_mismatching_text_whole():
    """benchmarks/server/server_load.py: a streamed text that differs from solo decoding is reported with
    where it departs and both texts, so a rare difference can be traced afterwards."""
    spec = importlib.util.spec_from_file_location("selfspec_server_load", BENCH.parent / "server_load.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH.parent))
    assert mod.mismatch(3, "def f(x): return x", "def f(y): return y") == {
        "prompt": 3, "at": 6, "got": "def f(x): return x", "want": "def f(y): return y"}
    assert mod.mismatch(0, "abc", "abcdef")["at"] == 3  # cut short: it departs where it ends
