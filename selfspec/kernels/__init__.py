"""A small-M matrix multiply for the CPU decode path: y[M, N] = x[M, K] @ w[K, N].

Why: torch's bf16 matmul (oneDNN) streams weights well below the memory's pace for the tiny M of decode
and speculative verification; this kernel comes near it on the 2-core AVX-512 box
(the same chains in AVX2 code on CPUs without AVX-512: csrc/simd.h, gemm.c's block_eo)
(the LM head of Gemma 3 270M in half torch's time; docs/performance.md).

Numerics (the contract callers rely on):
  * every output element is ONE fp32 FMA chain in increasing k:
        acc = +0.0f; for k in 0..K-1: acc = fma(float(x[m, k]), float(w[k, n]), acc)
    bf16 -> fp32 conversions are exact; there is no split over K, no tree reduction.
  * so row m of the result is bit-identical whatever M is (verify over M rows == M
    single-row passes), whatever the thread count and whether w is plain or packed.
  * output dtype = x's dtype; bf16 output is round-to-nearest-even of the fp32 accumulator
    (NaN -> canonical NaN), like torch's float -> bfloat16 conversion.
  * results differ from torch's `x @ w` only by accumulation order (torch is not
    row-invariant anyway); both are fp32 accumulations of the same exact products.
  * pair layout (pack(w, pairs=True), the default for bf16 weights on CPUs with AVX512-BF16):
    x is first rounded to bf16 and the chain takes k two at a time, odd term then even term,
    with denormals treated as zero (VDPBF16PS's definition). Same guarantees (row-, thread-
    invariant, one chain per element), its own bits; faster at 2-9 rows, where the
    FMA path is compute-bound (speculative verification).
  * AMX (pack(w, amx=True); the runtime's bf16 layer matrices on CPUs with AMX-BF16 unless
    SELFSPEC_AMX=0): the pair layout's products run as TDPBF16PS tile instructions, 16 pairs
    of k per instruction, chunks in increasing k. The hardware's sum inside an instruction
    matches no sequential chain, so these are bits of their own, but the same for every M
    and thread count (row-invariant: verification == decode); faster at several rows, the more
    rows the more (prefill; docs/how-it-works.md). The chain belongs to the weight: the LM head keeps VDPBF16PS's.

API:
  available() -> bool          the compiled kernel can be used (CPU, compiler, env)
  supports(x, w) -> bool       available() and these operands are acceptable to matmul
  matmul(x, w) -> Tensor       x [M, K] (bf16/fp32, CPU), w [K, N] tensor (bf16/fp32, CPU,
                               contiguous) or a PackedWeight; raises ValueError otherwise
  has_pairs() -> bool          the pair (VDPBF16PS) path is compiled in and usable
  amx() -> bool                AMX tiles are usable and wanted here (see above)
  pack(w) -> PackedWeight      w [K, N] re-laid out as [ceil(N/64), K, 64] (zero padded), or
                               [ceil(N/64), ceil(K/2), 64, 2] with pairs (see above):
                               each 64-column tile becomes one contiguous stream, ~20-30%
                               faster than the plain layout on large N (the LM head).
                               PackedWeight.unpack() gives back the [K, N] tensor.
  sampling_functions()         the entry points of csrc/sampling.c (one row's top-k/top-p
                               distribution and draws; used by selfspec/sampling.py), or None

The C sources (csrc/*.c) are compiled on first use with gcc -O3 -march=native -pthread
into ~/.cache/selfspec/kernels/<hash>/libgemm.so (hash of source, flags, compiler and CPU
flags; written to a temp file then os.replace'd) and called through ctypes. Anything that
goes wrong (no gcc, no AVX2, compile error, SELFSPEC_NO_KERNELS=1) makes available()
return False; callers then use torch. Work is split over N across the kernels' own thread
pool (csrc/pool.c: the same workers for every calling thread), threads() of them; a
generation runs in compute_scope(), which keeps torch's OpenMP threads off those cores
(pool.py).
No autograd: use under torch.no_grad() / inference_mode (results carry no grad_fn).

Modules: build (compile, load, available), weights (PackedWeight, QuantizedWeight, pack),
gemm (matmul), ggml (GGUF blocks to fp32), ggml_gemm (GGMLWeight: GGUF blocks
multiplied as stored, csrc/ggml_gemm.c), blocks (fused sub-layers, norm, soft-cap), sampling (csrc/sampling.c), pool
(threads(): how many the kernels use; compute_scope()).
"""

from __future__ import annotations

from selfspec.kernels.blocks import FusedBlocks, StepArgmax, norm_rows, rope_rows, softcap_
from selfspec.kernels.build import _cpu_flags, amx, available, build_id, has_pairs, load_error
from selfspec.kernels.gemm import _reference_fp32, _reference_pairs, matmul, supports
from selfspec.kernels.sampling import sampling_functions
from selfspec.kernels.pool import compute_scope, threads
from selfspec.kernels.weights import PackedWeight, QuantizedWeight, _qgemm_ref, chunk_rows, nbytes, pack, pack_parts, pack_rows, quant_errors

__all__ = ["available", "amx", "has_pairs", "supports", "matmul", "chunk_rows", "nbytes", "pack", "pack_parts", "pack_rows", "PackedWeight", "FusedBlocks", "StepArgmax", "rope_rows", "norm_rows",
           "softcap_", "QuantizedWeight", "quant_errors", "sampling_functions", "build_id", "load_error", "threads",
           "compute_scope"]
