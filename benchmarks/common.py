"""Shared bits for the benchmark scripts: prompts, the machine's copy bandwidth, the
transformers reference loaded from the same converted checkpoint as selfspec, and stopping a
`selfspec serve` subprocess."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import time

import torch

PROMPTS = [
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "The history of the printing press begins",
    "Q: Why is the sky blue?\nA:",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "Once upon a time, in a small village by the sea,",
]


def copy_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Memory traffic of a large copy, bytes read + bytes written per second, best of a few runs."""
    src = torch.ones(size_mb * 2**20, dtype=torch.uint8)
    dst = torch.zeros_like(src)  # touched: page faults are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best / 1e9


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def hf_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from selfspec.loading import default_model_dir

    return AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=dtype, local_files_only=True).eval()


def hf_generate_tps(hf, ids: list[int], max_new_tokens: int, **kwargs) -> tuple[float, list[int]]:
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    dt = time.perf_counter() - t
    new = out[0, len(ids):].tolist()
    return len(new) / dt, new


def hf_batch(hf, ids: list[list[int]], n_new: int) -> tuple[float, list[list[int]]] | None:
    """transformers' own continuous batching (`generate_batch`, greedy, no EOS stop) on these
    token ids: (seconds, generated ids per prompt in order), or None where it is missing."""
    if not hasattr(hf, "generate_batch"):
        return None
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=n_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    t = time.perf_counter()
    out = hf.generate_batch(inputs=ids, generation_config=cfg, progress_bar=False)
    dt = time.perf_counter() - t
    by_id = sorted(out.values(), key=lambda o: int(str(o.request_id).rsplit("_", 1)[-1]))
    return dt, [list(o.generated_tokens) for o in by_id]


def stop_server(proc: subprocess.Popen) -> int | None:
    """SIGTERM a `selfspec serve` started in its own session (start_new_session=True), then
    SIGKILL its process group if it has not exited within 30 s: only what it started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode
