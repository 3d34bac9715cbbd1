"""The bf16 kernels of bf16.c, for decode and attention on CPUs with AVX-512.

A decode step multiplies a few rows (one per sequence) by every weight, so decode speed is the speed
at which weights stream from RAM; oneDNN's bf16 path reads them at about half of what one core can
and pays ~15 us a call (docs/benchmarks.md#decode-speed). The kernels read each weight once for up
to MAX_ROWS rows. bf16.c is built one of three ways (`isa()`): with AVX512-BF16's instructions where
the CPU has them, else with those two instructions written out in AVX512F (Intel's Skylake-SP,
Cascade Lake, Ice Lake), else, without AVX-512, with every AVX-512 operation written out in AVX2 and
FMA (avx2_512.h: AMD's Zen 2 and 3, Intel's client cores), the same bits every way;
HYBRIDMOE_BF16_ISA (env.py) picks a narrower one. Without AVX2 and FMA or a C compiler (build.py),
or with HYBRIDMOE_NATIVE=0, `available()` is False and callers keep torch's path.

Used by layers/ (dense projections, layers/linear.py; decode and prefill attention,
layers/attention.py) and experts/ (expert FFNs).
"""

from __future__ import annotations

import struct
from functools import lru_cache
from pathlib import Path

import torch

from hybridmoe import env
from hybridmoe.native.build import (
    INT,
    F,
    N,
    P,
    cpu_family,
    cpu_flags,
    cpu_is_amd,
    far_hint_flag,
    load,
    switch,
)
from hybridmoe.native.threads import kernel_threads

SOURCE = Path(__file__).with_name("bf16.c")
HEADERS = tuple(Path(__file__).with_name(h) for h in ("pool.h", "rows.h", "mix.h", "avx2_512.h"))
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-shared", "-fPIC"]
# -ffp-contract=off: the floats as written (rows.h); the kernels ask for their FMAs by name
FLAGS += ["-pthread", "-ffp-contract=off"]
# How a one-row product asks for the weights it streams: non-temporal on AMD's Zen 4 (family 25:
# keeps the caches of the Python between kernels), into L1 and L2 elsewhere (Intel: 1.5x the read
# rate; AMD's Zen 5, family 26, an EPYC VM: the demo's decode at one thread 71-77 -> 94-110 tok/s,
# at two 116-120 -> 120-132, docs/notes/2026-12-07-bf16-emulated.md); bf16.c, NTA_AHEAD
WEIGHTS_NTA = cpu_is_amd() and cpu_family() == 25
FLAGS += [f"-DWEIGHTS_NTA={int(WEIGHTS_NTA)}"]
# How the lines 4 KB ahead are asked for where WEIGHTS_NTA is off (build.py far_hint_flag)
FLAGS += [far_hint_flag()]

# The builds, as isa() numbers them: FLAGS (AVX512-BF16's instructions), FLAGS with those
# instructions' definitions in AVX512F instead (bf16.c, EMULATE_BF16), or those definitions and
# every AVX-512 operation in AVX2 and FMA (AVX2_512: avx2_512.h): flags()
AVX2, EMULATED, NATIVE = 1, 2, 3
# HYBRIDMOE_BF16_ISA's names for the builds
BUILD_NAMES = {"avx512bf16": NATIVE, "avx512f": EMULATED, "avx2": AVX2, "off": 0}
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")


def flags(build: int) -> list[str]:
    """The compiler flags of a build (NATIVE, EMULATED or AVX2)."""
    if build == NATIVE:
        return FLAGS
    if build == EMULATED:
        return [f for f in FLAGS if f != "-mavx512bf16"] + ["-DEMULATE_BF16"]
    # -Wno-psabi: avx2_512.h's 512-bit values are structs in registers, never passed between builds
    narrow = [f for f in FLAGS if f not in _AVX512]
    return narrow + ["-mavx2", "-mfma", "-DEMULATE_BF16", "-DAVX2_512", "-Wno-psabi"]


# Rows up to which the kernels take a call: one thread, weights from RAM, they beat oneDNN's bf16
# linear at every row count up to 32 and are about even at 48, where they turn compute-bound
# (docs/notes/2026-11-24-measurements-in-code.md, "MAX_ROWS"). Beyond, prefill keeps oneDNN.
MAX_ROWS = 32

# Weight bytes below which a product stays on one thread whatever torch's count: waking the pool's
# second thread costs as much as it saves on a matrix this small (on the AMD Zen 4 machine the demo
# model's 576 x 576 took 60 us on one thread and on two, its 192 x 576 25 and 31 us, its 1536 x 576
# 153 and 95 us: docs/notes/2026-11-24-decode-overhead.md, with 1 MB here). With the weights in
# 2 MB pages and the pool's workers spinning between a step's regions, on the Intel Xeon machine
# 256 KB (the demo's 576 x 576 products on both threads) took its attention half 315-330 -> 251 us a
# layer and its decode 29.3 -> 25.6 ms a token at two threads; 128 KB was level with 256 KB
# (docs/notes/2026-12-06-decode-step-glue.md).
THREADED_MIN_BYTES = 1 << 18

# name -> (argument types, result type), each under a copy of its C prototype in bf16.c
SIGNATURES = {
    # void hm_gemm_bf16(const uint16_t *W, const uint16_t *X, long ldx, float *Y, long ldy, long O,
    #                   long I, long M)
    "hm_gemm_bf16": ([P, P, N, P, N, N, N, N], None),
    # void hm_expert_rows_bf16(const uint16_t *gate_up, const uint16_t *down, const uint16_t *X,
    #                          long ldx, float *Y, long ldy, long M, long H, long I, float *scratch,
    #                          uint16_t *h)
    "hm_expert_rows_bf16": ([P, P, P, N, P, N, N, N, N, P, P], None),
    # void hm_gemm_bf16_mt(const uint16_t *W, const uint16_t *X, long ldx, float *Y, long ldy,
    #                      long O, long I, long M, int threads)
    "hm_gemm_bf16_mt": ([P, P, N, P, N, N, N, N, INT], None),
    # int hm_decoder_attention_bf16(const attn_block *a, const uint16_t *in_w,
    #     const uint16_t *post_w, float norm_eps, const uint16_t *X, long ldx, long T,
    #     const float *C, const float *S, long ldc, const int64_t *slots, const int32_t *tables,
    #     const int32_t *table_starts, const int32_t *lengths, const int32_t *rows, long n,
    #     long block_size, float scale, float eps, uint16_t *x_out, uint16_t *h_out, int threads,
    #     long threaded_min_bytes, const uint16_t *next_w, long next_rows, uint16_t *next_out)
    "hm_decoder_attention_bf16": (
        [P, P, P, F, P, N, N, P, P, N, P, P, P, P, P, N, N, F, F, P, P, INT, N, P, N, P],
        INT,
    ),
    # long hm_decode_layers_bf16(const int64_t *layers, long L, long T, long H, const uint16_t *X,
    #     const float *C, const float *S, long ldc, const int64_t *slots, const int32_t *tables,
    #     const int32_t *table_starts, const int32_t *lengths, const int32_t *rows, long n,
    #     long block_size, int threads, long threaded_min_bytes, int workers, qmoe_fn qmoe, int isa,
    #     uint16_t *hs, int64_t *ids, float *w, double *secs, uint16_t *x_out)
    "hm_decode_layers_bf16": (
        [P, N, N, N, P, P, P, N, P, P, P, P, P, N, N, INT, N, INT, P, INT, P, P, P, P, P],
        N,
    ),
    # int hm_moe_token_bf16(const int64_t *experts, const int64_t *ids, const float *w, long K,
    #                       const uint16_t *x, long H, long I, int threads, uint16_t *out)
    "hm_moe_token_bf16": ([P, P, P, N, P, N, N, INT, P], INT),
    # int hm_moe_tokens_bf16(const int64_t *experts, long E, const int64_t *ids, const float *w,
    #                        long T, long K, const uint16_t *x, long H, long I, int threads,
    #                        uint16_t *out)
    "hm_moe_tokens_bf16": ([P, N, P, P, N, N, P, N, N, INT, P], INT),
    # int hm_shared_moe_token_bf16(const int64_t *experts, const int64_t *ids, const float *w,
    #     long K, const uint16_t *x, long H, long I, const uint16_t *gu, const uint16_t *down,
    #     long S, const uint16_t *resid, int threads, uint16_t *out)
    "hm_shared_moe_token_bf16": ([P, P, P, N, P, N, N, P, P, N, P, INT, P], INT),
    # int hm_shared_moe_tokens_bf16(const int64_t *experts, long E, const int64_t *ids,
    #     const float *w, long T, long K, const uint16_t *x, long H, long I, const uint16_t *gu,
    #     long ldg, const uint16_t *down, long S, const uint16_t *resid, int threads, uint16_t *out)
    "hm_shared_moe_tokens_bf16": ([P, N, P, P, N, N, P, N, N, P, N, P, N, P, INT, P], INT),
    # void hm_linear_bf16(const uint16_t *W, const uint16_t *X, long ldx, const uint16_t *bias,
    #                     uint16_t *Y, long ldy, long O, long I, long M, int threads)
    "hm_linear_bf16": ([P, P, N, P, P, N, N, N, N, INT], None),
    # void hm_experts_bf16(const bexpert_job *e, long n, long H, long I, int threads)
    "hm_experts_bf16": ([P, N, N, N, INT], None),
    # int hm_decode_attention_bf16(const uint16_t *Q, long ldq, const uint16_t *K, long ldk,
    #     const uint16_t *V, long ldv, const int32_t *tables, const int32_t *table_starts,
    #     const int32_t *lengths, const int32_t *rows, long n, long block_size, long heads,
    #     long kv_heads, long d, long dv, float scale, void *out, long ldo, int out_bf16,
    #     int threads)
    "hm_decode_attention_bf16": (
        [P, N, P, N, P, N, P, P, P, P, N, N, N, N, N, N, F, P, N, INT, INT],
        INT,
    ),
    # int hm_prefill_attention_bf16(const uint16_t *Q, long ldq, long ldqh, const uint16_t *K,
    #     long ldk, long ldkh, const uint16_t *V, long ldv, long ldvh, long n, long L, long heads,
    #     long kv_heads, long d, long dv, float scale, void *out, long ldo, int out_bf16)
    "hm_prefill_attention_bf16": ([P, N, N, P, N, N, P, N, N, N, N, N, N, N, N, F, P, N, INT], INT),
    # void hm_bind_quant(qlinear_fn f, qmany_fn g): quant.c's hm_qlinear and hm_qlinear_many, for
    # attention weights in blocks
    "hm_bind_quant": ([P, P], None),
    # void hm_share_pool(parallel_fn f): run this library's regions on another's pool (pool.h)
    "hm_share_pool": ([P], None),
    # int hm_amx_permit(void); void hm_set_amx(int on): the decode attention on AMX tiles
    "hm_amx_permit": ([], INT),
    "hm_set_amx": ([INT], None),
    # int hm_fma_pairs_check(void); void hm_set_fma_pairs(int on): products of several rows as fma
    # pairs with vdpbf16ps's bits, where this CPU's vdpbf16ps is Intel's definition of it
    "hm_fma_pairs_check": ([], INT),
    "hm_set_fma_pairs": ([INT], None),
    # void hm_round_bf16(const float *x, long n, uint16_t *out): vcvtneps2bf16 or its definition
    "hm_round_bf16": ([P, N, P], None),
}


def cpu_has_avx512_bf16() -> bool:
    """AVX512-BF16: the kernels' own build (else their instructions are emulated)."""
    return "avx512_bf16" in cpu_flags()


def cpu_runs_kernels() -> bool:
    """Whether a build of the kernels runs on this CPU (AVX2 and FMA at least); without one
    torch's path runs."""
    return best_isa() > 0


def best_isa() -> int:
    """The widest build this CPU runs: NATIVE with AVX512-BF16, EMULATED with AVX512F, BW and VL
    alone, AVX2 with AVX2 and FMA, else 0 (torch's path)."""
    if not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        return AVX2 if {"avx2", "fma"} <= cpu_flags() else 0
    return NATIVE if cpu_has_avx512_bf16() else EMULATED


def isa() -> int:
    """The build in use: HYBRIDMOE_BF16_ISA's (avx512bf16, avx512f, avx2, off), capped at what the
    CPU runs."""
    wanted = BUILD_NAMES.get(env.bf16_isa() or "", NATIVE)
    return min(wanted, best_isa())


def kernels_beat_onednn() -> bool:
    """Whether the kernels take bf16 products of any row count, not only decode's few (MAX_ROWS):
    where the CPU multiplies no bf16 in hardware, oneDNN's bf16 products are emulated and the
    kernels beat them at every size (512 x 1536 x 576, one thread: 10.9 -> 4.3 ms on a Cascade
    Lake stand-in, 37.3 -> 12.6 ms capped to AVX2; docs/notes/2026-12-07-bf16-on-avx2.md)."""
    return not cpu_has_native_bf16()


def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), so oneDNN's bf16 matrix
    products beat fp32 ones; without it torch emulates bf16, slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


@lru_cache(maxsize=1)
def library():
    """The compiled kernels, or None where they cannot run here (see the module's docstring)."""
    build = isa()
    lib = load(SOURCE, flags(build), SIGNATURES, HEADERS) if build else None
    if lib is not None:
        _FMA_PAIRS[:] = [bool(lib.hm_fma_pairs_check())]  # permitted where it passed
        _FMA_ON[0] = _FMA_PAIRS[0] and FMA_PAIRS_PAY
        lib.hm_set_fma_pairs(int(_FMA_ON[0]))
    _AMX_ON[0] = False
    if lib is not None and env.amx_enabled() and _amx_allowed(lib):
        lib.hm_set_amx(1)
        _AMX_ON[0] = True
    return lib


_FMA_PAIRS: list[bool] = []  # whether this CPU's vdpbf16ps passed hm_fma_pairs_check
_FMA_ON = [False]  # what bf16.c's hm_set_fma_pairs was last told

# Whether the fma pairs beat vdpbf16ps in products of several rows, by the CPU's vendor (as
# WEIGHTS_NTA): on Intel's cores vdpbf16ps issues once in two cycles and zmm fma on two ports (a
# Sapphire Rapids-class VM: 512 x 576 x 576 3.35 -> 2.3 ms, docs/notes/2026-12-07-fma-pairs.md); on
# AMD's Zen 5 (an EPYC VM, one thread) vdpbf16ps took 0.39-0.54x the pairs' time from 16 rows on
# (4096 x 2048 from RAM, 512-row products from cache), 0.84-0.89x at 12-15 rows, 1.04-1.14x at 3-6
# (docs/notes/2026-12-07-bf16-emulated.md). Zen 4 is not measured.
FMA_PAIRS_PAY = not cpu_is_amd()


def use_fma_pairs(on: bool) -> bool:
    """Products of several rows as fma pairs (on: where this CPU's vdpbf16ps gives their bits, which
    the library checks when it loads) or on vdpbf16ps (off; in the EMULATED build, its definition);
    the same bits either way. Returns whether they are on now."""
    lib = library()
    return switch(lib, "hm_set_fma_pairs", _FMA_ON, on, lambda: _FMA_PAIRS[0])


def fma_pairs_active() -> bool:
    """Whether products of several rows take the fma pairs now."""
    library()
    return _FMA_ON[0]


def cpu_has_amx() -> bool:
    """AMX tiles with bf16 products (Sapphire Rapids and later; not AMD's Zen 4)."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


_AMX_GRANTED: list[bool] = []  # once asked
_AMX_ON = [False]  # what bf16.c's hm_set_amx was last told


def amx_permitted(lib) -> bool:
    """Whether this process may use the tiles: Linux grants their state on request (5.16 on)."""
    if not _AMX_GRANTED:
        _AMX_GRANTED.append(cpu_has_amx() and bool(lib.hm_amx_permit()))
    return _AMX_GRANTED[0]


def use_amx(on: bool) -> bool:
    """Put the decode attention on the AMX tiles or off them (bf16.c scores_amx, values_amx); on
    only where the CPU has them and the process was granted them (HYBRIDMOE_AMX=0 starts with
    them off). Returns whether they are on now."""
    lib = library()
    return switch(lib, "hm_set_amx", _AMX_ON, on, lambda: _amx_allowed(lib))


def _amx_allowed(lib) -> bool:
    """The tiles with the native build alone: the emulated one stands for a CPU without them."""
    return isa() == NATIVE and amx_permitted(lib)


def amx_active() -> bool:
    """Whether the decode attention runs on the AMX tiles now."""
    library()
    return _AMX_ON[0]


def available() -> bool:
    return library() is not None


# The checks below run a few times per layer of every decode step: plain loops over the cheapest
# tensor attributes (`is_cpu`, `dtype is`), not generators over `device.type`, which cost several
# times more (docs/notes/2026-11-24-gemv-streams.md).
_BF16 = torch.bfloat16


def _bf16_on_cpu(*tensors: torch.Tensor) -> bool:
    for t in tensors:
        if t.dtype is not _BF16 or not t.is_cpu:
            return False
    return True


def applies(x: torch.Tensor, *weights: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether the kernels take this call: up to max_rows bf16 rows on the CPU,
    contiguous bf16 weights."""
    if x.dtype is not _BF16 or not x.is_cpu or x.numel() > max_rows * x.shape[-1]:
        return False
    return weights_apply(*weights)


def weights_apply(*weights) -> bool:
    """Whether the kernels read these weights: contiguous bf16 tensors on the CPU."""
    for w in weights:
        if not isinstance(w, torch.Tensor) or w.dtype is not _BF16 or not w.is_cpu:
            return False
        if not w.is_contiguous():
            return False
    return available()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x: [..., K] as [M, K] with unit stride along K (rows may be further apart than K). Checked
    before reshaping: each torch call costs about 1 us, as much as a small kernel."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])  # [M, K]
    return x if x.stride(-1) == 1 else x.contiguous()


def _threaded(weight_bytes: int, rows: int) -> bool:
    """Whether a product takes the pool's threads: a weight of THREADED_MIN_BYTES or more, or more
    rows than a decode batch (a prefill chunk's: the demo's 192 x 576 k and v projections of 512
    rows took 37 ms of a 1.3 s prefill on one thread of two). The bits are the same either way."""
    return weight_bytes >= THREADED_MIN_BYTES or rows > MAX_ROWS


def gemm(x: torch.Tensor, weight: torch.Tensor, workers: int | None = None) -> torch.Tensor:
    """x: [..., K] with M rows, weight: [N, K], both bf16 -> [M, N] fp32, accumulated in fp32, its
    rows split over `workers` threads (default torch's count; the same bits on any count)."""
    x = _rows(x)  # [M, K]
    n, k = weight.shape
    y = torch.empty(x.shape[0], n, dtype=torch.float32)  # [M, N]
    threads = workers or kernel_threads()
    if not _threaded(2 * weight.numel(), x.shape[0]):
        threads = 1
    args = (weight.data_ptr(), x.data_ptr(), x.stride(0), y.data_ptr(), n, n, k, x.shape[0])
    if threads > 1:
        library().hm_gemm_bf16_mt(*args, threads)
    else:
        library().hm_gemm_bf16(*args)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for bf16 rows: x [M, K], weight [N, K], bias [N] (bf16) or None -> [M, N] bf16, with
    torch's arithmetic (fp32 sums, the bias added in fp32, one rounding), in one call."""
    x = _rows(x)  # [M, K]
    n, k = weight.shape
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)  # [M, N]
    threads = kernel_threads() if _threaded(2 * n * k, x.shape[0]) else 1
    library().hm_linear_bf16(
        weight.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n,
        n,
        k,
        x.shape[0],
        threads,
    )
    return y


def _jobs(xs, weights, y, gu, h):
    """hm_experts_bf16's table [n, 8] for tokens xs[j] [M_j, H] through weights[j], the outputs and
    scratch of each laid out one expert after the other in y, gu and h."""
    hidden, inter = weights[0][1].shape
    yp, gp, hp = y.data_ptr(), gu.data_ptr(), h.data_ptr()
    table, rows = [], {}  # rows: id(x) -> (pointer, row stride), each distinct x checked once
    for x, (gate_up, down) in zip(xs, weights):
        px = rows.get(id(x))
        if px is None:
            r = _rows(x)
            px = rows[id(x)] = (r.data_ptr(), r.stride(0), r)
        m = x.shape[0]
        table += [gate_up.data_ptr(), down.data_ptr(), px[0], px[1], m, yp, gp, hp]
        yp, gp, hp = yp + 4 * m * hidden, gp + 8 * m * inter, hp + 2 * m * inter
    return torch.tensor(table, dtype=torch.int64)  # [n, 8]


def _buffers(tokens: int, hidden: int, inter: int):
    return (
        torch.empty(tokens, hidden, dtype=torch.float32),  # [sum M_j, H], expert after expert
        torch.empty(tokens, 2 * inter, dtype=torch.float32),  # gate and up of each token
        torch.empty(tokens, inter, dtype=torch.bfloat16),  # silu(gate) * up of each token
    )


def experts(
    xs: list[torch.Tensor],
    weights: list[tuple[torch.Tensor, torch.Tensor]],
    workers: int,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """`expert` of each (tokens xs[j] [M_j, H] bf16, weights[j] = (gate_up [2I, H], down [H, I]))
    in one call over `workers` threads -> [M_j, H] each, the same bits as `expert`, rounded once
    to `dtype`. Python work is kept to a few calls per expert: a decode layer is small enough for
    it to show."""
    hidden, inter = weights[0][1].shape
    counts = [x.shape[0] for x in xs]
    y, gu, h = _buffers(sum(counts), hidden, inter)
    jobs = _jobs(xs, weights, y, gu, h)
    library().hm_experts_bf16(jobs.data_ptr(), len(xs), hidden, inter, workers)
    return list((y if dtype == torch.float32 else y.to(dtype)).split(counts))


def moe_tokens(
    table: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    inter: int,
    workers: int,
) -> torch.Tensor:
    """Tokens x [T, H] bf16 (contiguous: a decode token, or a prefill chunk whose rows are
    computed as if alone) through their routed experts and the weighted sums -> [T, H] bf16: the
    bits of `experts` on each expert's tokens (rounded to bf16), then experts/run/ffn.py's
    combine_token or combine_grouped. table: int64 [E, 2], each expert's gate_up [2I, H] and down
    [H, I] pointers; ids [T, K] int64 and weights [T, K] fp32 as the router gives them (unsorted),
    contiguous. One token takes hm_moe_token_bf16 (no grouping, no gathered rows: a decode step's),
    more hm_moe_tokens_bf16."""
    tokens, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16)  # [T, H]
    k, ptrs = ids.shape[1], (ids.data_ptr(), weights.data_ptr())
    if tokens == 1:
        args = (table.data_ptr(), *ptrs, k, x.data_ptr(), hidden, inter, workers, out.data_ptr())
        status = library().hm_moe_token_bf16(*args)
    else:
        args = (table.data_ptr(), table.shape[0], *ptrs, tokens, k, x.data_ptr(), hidden, inter)
        status = library().hm_moe_tokens_bf16(*args, workers, out.data_ptr())
    if status == -1:
        raise ValueError(f"moe_tokens: an expert id outside [0, {table.shape[0]}) or top-k > 64")
    if status != 0:
        raise MemoryError("moe_tokens: no memory for its scratch")
    return out


def shared_moe_token(
    table: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    inter: int,
    shared: tuple[torch.Tensor, int, torch.Tensor],
    resid: torch.Tensor,
    workers: int,
) -> torch.Tensor:
    """resid + (routed + sigmoid(gate) * down(silu(g) * u)) [T, H] bf16 for T decode tokens: a
    Qwen2-MoE block after its router, with the decoder layer's residual sum (models/qwen2_moe.py's
    bits, each token's as if alone). routed: `moe_tokens`' arguments (x [T, H] the block's input);
    shared = (rows [T, N] bf16, contiguous, each holding the shared expert's gate logit at `at`
    and its gate and up rows [2S] right after, at, down [H, S] bf16); resid [T, H] bf16. One token
    takes hm_shared_moe_token_bf16, more hm_shared_moe_tokens_bf16 (each expert read once for its
    tokens)."""
    row, at, down = shared
    hidden, s = down.shape
    tokens = x.shape[0]
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16)  # [T, H]
    ptrs = (ids.data_ptr(), weights.data_ptr())
    tail = (row.data_ptr() + 2 * at, down.data_ptr(), s, resid.data_ptr(), workers, out.data_ptr())
    if tokens == 1:
        args = (table.data_ptr(), *ptrs, ids.shape[1], x.data_ptr(), hidden, inter)
        status = library().hm_shared_moe_token_bf16(*args, *tail)
    else:
        args = (table.data_ptr(), table.shape[0], *ptrs, tokens, ids.shape[1], x.data_ptr())
        gu = (row.data_ptr() + 2 * at, row.shape[1])
        status = library().hm_shared_moe_tokens_bf16(*args, hidden, inter, *gu, *tail[1:])
    if status == -1:
        raise ValueError(
            f"shared_moe_token: an expert id outside [0, {table.shape[0]}) or top-k > 64"
        )
    if status != 0:
        raise MemoryError("shared_moe_token: no memory for its scratch")
    return out


def expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """M tokens through a SwiGLU expert: x: [M, H] bf16, gate_up: [2I, H],
    down: [H, I] -> [M, H] fp32."""
    x = _rows(x)  # [M, H]
    m, (hidden, inter) = x.shape[0], down.shape
    y = torch.empty(m, hidden, dtype=torch.float32)  # [M, H]
    scratch = torch.empty(m, 2 * inter, dtype=torch.float32)  # [M, 2I]: gate and up, fp32
    h = torch.empty(
        m, inter, dtype=torch.bfloat16
    )  # [M, I]: silu(gate) * up, the down projection's input
    library().hm_expert_rows_bf16(
        gate_up.data_ptr(),
        down.data_ptr(),
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        hidden,
        m,
        hidden,
        inter,
        scratch.data_ptr(),
        h.data_ptr(),
    )
    return y


def attention_applies(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether decode_attention takes these: bf16 queries and pools on the CPU,
    the pools' rows contiguous."""
    return (
        _bf16_on_cpu(q, k_pool, v_pool)
        and k_pool.is_contiguous()
        and v_pool.is_contiguous()
        and available()
    )


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    table_starts: torch.Tensor,
    lengths: torch.Tensor,
    rows: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention of one query token per sequence over its paged history, into out's rows.

    q: [T, h, d] bf16; k_pool: [slots, kvh, d], v_pool: [slots, kvh, dv] bf16; out: [T, h, dv] bf16
    or fp32, rows contiguous. Sequence s (int32 tensors [S]): query and output row rows[s],
    positions 0..lengths[s]-1, position l at slot table[l // block_size] * block_size
    + l % block_size where table = tables[table_starts[s]:]. Scores and sums in fp32; query head i
    uses KV head i // (h // kvh). The sequences are shared over the kernels' threads (a prefill
    chunk's rows come here as sequences of lengths 1..n); the bits do not depend on the count.
    """
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        q = q.contiguous()
    heads, d = q.shape[1:]
    kv_heads, dv = v_pool.shape[1:]
    assert out.stride(-1) == 1 and out.stride(-2) == dv and heads % kv_heads == 0
    status = library().hm_decode_attention_bf16(
        q.data_ptr(),
        q.stride(0),
        k_pool.data_ptr(),
        k_pool.stride(0),
        v_pool.data_ptr(),
        v_pool.stride(0),
        tables.data_ptr(),
        table_starts.data_ptr(),
        lengths.data_ptr(),
        rows.data_ptr(),
        len(rows),
        block_size,
        heads,
        kv_heads,
        d,
        dv,
        scale,
        out.data_ptr(),
        out.stride(0),
        out.dtype == torch.bfloat16,
        kernel_threads(),
    )
    if status != 0:
        raise MemoryError("decode attention: no memory for its scratch")


def prefill_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether prefill_attention takes these: bf16 on the CPU,
    unit stride along the head dimension."""
    return (
        _bf16_on_cpu(q, k, v) and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and available()
    )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Causal attention of a chunk: q [n, h, d], k [L, kvh, d], v [L, kvh, dv] bf16 -> [n, h, dv]
    out_dtype (bf16 or fp32).

    The n queries are the last n of the L positions; query head i uses KV head i // (h // kvh).
    Scores, softmax and sums in fp32; a bf16 result is the fp32 one rounded once. k and v may be
    strided views (a pool's rows): the kernel packs each KV head once per call anyway.
    """
    n, heads, d = q.shape
    length, kv_heads, dv = v.shape
    assert heads % kv_heads == 0 and k.shape[:2] == (length, kv_heads) and k.shape[2] == d
    out = torch.empty(n, heads, dv, dtype=out_dtype)  # [n, h, dv]
    status = library().hm_prefill_attention_bf16(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k.data_ptr(),
        k.stride(0),
        k.stride(1),
        v.data_ptr(),
        v.stride(0),
        v.stride(1),
        n,
        length,
        heads,
        kv_heads,
        d,
        dv,
        scale,
        out.data_ptr(),
        heads * dv,
        out_dtype == torch.bfloat16,
    )
    if status != 0:
        raise MemoryError("prefill attention: no memory for its scratch")
    return out


def _step_args(cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, decode) -> tuple:
    """The step's arguments of bf16.c's decoder attention calls, in their order: C, S, ldc, slots,
    tables, table_starts, lengths, rows, n, block_size."""
    return (
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        slots.data_ptr(),
        decode.tables.data_ptr(),
        decode.table_starts.data_ptr(),
        decode.lengths.data_ptr(),
        decode.rows.data_ptr(),
        len(decode.rows),
        decode.block_size,
    )


def decoder_attention(
    table: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    decode,
    scale: float,
    eps: float,
    next_w: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A decoder layer's attention half in one call (bf16.c hm_decoder_attention_bf16): x [T, H]
    bf16 -> (x + attention(RMSNorm(x)), RMSNorm of that) [T, H] bf16 each, the bits of
    layers/decoder.py's steps, and where next_w [N, H] (bf16, contiguous) is given `linear` of the
    second and next_w [T, N] (else None). norms: the input and post-attention norms' weights [H]
    bf16 and their eps; table: the block's weights and pools (bf16.c attn_block,
    Attention._block_table); cos, sin: [T, d] fp32; slots: int64 [T], each row's pool slot; decode:
    the step's DecodeTables, covering every row."""
    in_w, post_w, norm_eps = norms
    x_out = torch.empty(x.shape, dtype=torch.bfloat16)  # [T, H]
    h_out = torch.empty(x.shape, dtype=torch.bfloat16)  # [T, H]
    n = 0 if next_w is None else next_w.shape[0]
    row = None if next_w is None else torch.empty(x.shape[0], n, dtype=torch.bfloat16)  # [T, N]
    status = library().hm_decoder_attention_bf16(
        table.data_ptr(),
        in_w.data_ptr(),
        post_w.data_ptr(),
        norm_eps,
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        *_step_args(cos, sin, slots, decode),
        scale,
        eps,
        x_out.data_ptr(),
        h_out.data_ptr(),
        kernel_threads(),
        THREADED_MIN_BYTES,
        0 if next_w is None else next_w.data_ptr(),
        n,
        0 if row is None else row.data_ptr(),
    )
    if status != 0:
        raise MemoryError("decoder attention: no memory for its scratch")
    return x_out, h_out, row


_F32 = struct.Struct("<f")

# A decode layer's fields for decode_layers (bf16.c decode_layer's order) and its kinds of experts
DECODE_FIELDS, DECODE_KIND = 16, 11  # DL_FIELDS, DL_KIND
EXPERTS_IN_BLOCKS, EXPERTS_BF16, EXPERTS_SHARED = 0, 1, 2


def f32_bits(v: float) -> int:
    """An fp32 value's bits as an int (a field of decode_layers' table)."""
    return int.from_bytes(_F32.pack(v), "little")


def decode_layers(
    fields: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    decode,
    workers: int,
    qmoe: tuple[int, int],
    top_k: int,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's L MoE layers in one call (bf16.c hm_decode_layers_bf16), each with the bits
    of its attention half, router and experts run one after another. fields: int64 [L,
    DECODE_FIELDS] (Attention.decode_fields, SparseMoE.decode_fields); x [T, H] bf16, one decode
    token of each sequence (T > 1: experts in blocks only); cos, sin, slots, decode:
    decoder_attention's; qmoe: quant.c hm_qmoe_tokens' address and path (0, 0 where no layer has
    experts in blocks). -> (layers done, x [T, H] the input of the first not done, each layer's
    experts' input [L, T, H], router ids [L, T, K] and weights [L, T, K], experts' seconds [L])."""
    count, (tokens, hidden) = fields.shape[0], x.shape
    x_out = torch.empty(tokens, hidden, dtype=torch.bfloat16)  # [T, H]
    hs = torch.empty(count, tokens, hidden, dtype=torch.bfloat16)  # [L, T, H]
    ids = torch.empty(count, tokens, top_k, dtype=torch.int64)  # [L, T, K]
    weights = torch.empty(count, tokens, top_k, dtype=torch.float32)  # [L, T, K]
    secs = torch.empty(count, dtype=torch.float64)  # [L]
    done = library().hm_decode_layers_bf16(
        fields.data_ptr(),
        count,
        tokens,
        hidden,
        x.data_ptr(),
        *_step_args(cos, sin, slots, decode),
        kernel_threads(),
        THREADED_MIN_BYTES,
        workers,
        qmoe[0],
        qmoe[1],
        hs.data_ptr(),
        ids.data_ptr(),
        weights.data_ptr(),
        secs.data_ptr(),
        x_out.data_ptr(),
    )
    return done, x_out, hs, ids, weights, secs
