"""Peak memory per labelled window of a measurement (bench, sweep, compare_all), in MiB."""

from __future__ import annotations

import resource
import sys
import threading
import time

import torch


class MemoryMonitor:
    """Peak memory per labelled window (e.g. "baseline" / "strategy"), in MiB.

    CUDA: torch.cuda.max_memory_allocated, reset per window. CPU, best first: Linux's
    resident high-water mark (VmHWM in /proc/self/status, reset per window by writing 5 to
    /proc/self/clear_refs: exact and free); else psutil's RSS sampled every 10 ms by a
    thread; else the process's ru_maxrss (a peak since start, not per window)."""

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.peaks: dict[str, float] = {}
        self._label: str | None = None
        self._wake = threading.Event()
        self._stop = False
        self._proc = None
        self._hwm = False
        if self.cuda:
            self.method = "torch.cuda.max_memory_allocated (per run)"
        elif _reset_hwm():
            self._hwm = True
            self.method = "peak RSS per run (Linux VmHWM, reset with /proc/self/clear_refs)"
        else:
            try:
                import psutil  # optional: not a dependency; only where /proc/self/clear_refs is missing

                self._proc = psutil.Process()
                self.method = "peak RSS while running (psutil, 10 ms samples)"
                threading.Thread(target=self._poll, daemon=True).start()
            except ImportError:
                self.method = "process peak RSS since start (ru_maxrss)"

    def _poll(self) -> None:
        while not self._stop:
            self._wake.wait()
            label = self._label
            if label is not None:
                self._note(label, self._rss())
            time.sleep(0.01)

    def _rss(self) -> float:
        try:
            return self._proc.memory_info().rss / 2**20
        except Exception:
            return 0.0

    def _note(self, label: str, mb: float) -> None:
        if mb > self.peaks.get(label, 0.0):
            self.peaks[label] = mb

    def start(self, label: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self._hwm:
            _reset_hwm()
        elif self._proc is not None:
            self._note(label, self._rss())
            self._label = label
            self._wake.set()

    def stop(self, label: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self._note(label, torch.cuda.max_memory_allocated() / 2**20)
        elif self._hwm:
            self._note(label, _read_hwm_mb() or 0.0)
        elif self._proc is not None:
            self._wake.clear()
            self._label = None
            self._note(label, self._rss())
        else:
            self._note(label, process_peak_rss_mb())

    def close(self) -> None:
        self._stop = True
        self._wake.set()


def _reset_hwm() -> bool:
    """Reset Linux's resident high-water mark to the current RSS; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _read_hwm_mb() is not None
    except OSError:
        return False


def _read_hwm_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_peak_rss_mb() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 2**10  # bytes on macOS, KiB on Linux
