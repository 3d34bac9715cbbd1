"""The integer kernels of quant.c: products with weights kept in GGUF blocks, activations quantised
once per row to int8, dot products in exact integers (AVX512-VNNI, AVX2 with AVX-VNNI, or AVX2),
scales applied in fp32.

Every instruction-set path is compiled into one library (per-function target attributes, no global
ISA flags) and gives the same bits; `isa()` picks the widest the CPU has, or the one
HYBRIDMOE_QUANT_ISA names (env.py). Without any path, or with the native code off, `available()`
is False and callers dequantise and use torch (hybridmoe/quant/tensor.py).

`rows` goes the other way for a few rows: blocks back to values, a token embedding's lookup.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from hybridmoe import env
from hybridmoe.native.build import (
    INT,
    N,
    P,
    assembles,
    cpu_flags,
    cpu_is_amd,
    far_hint_flag,
    load,
    switch,
)
from hybridmoe.native.threads import kernel_threads

SOURCE = Path(__file__).with_name("quant.c")
HEADERS = tuple(Path(__file__).with_name(h) for h in ("pool.h", "rows.h", "mix.h"))
# no global ISA flags (each path has its own target attribute); floats exactly as written, so that
# both paths round alike; the worker threads of pool.h
FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-pthread"]
# Whether one-token K-quant products ask for the weights just ahead into L1 as well as further
# ahead into L2: on Intel's cores, which asked too late for them otherwise; on AMD's Zen 5 the near
# requests cost a product from RAM a quarter of its rate (quant.c, NEAR_PREFETCH)
FLAGS += [f"-DNEAR_PREFETCH={int(not cpu_is_amd())}"]
# How one-token products ask for the weights further ahead (build.py far_hint_flag)
FLAGS += [far_hint_flag()]
# AVX-VNNI's instructions as quant.c writes them (inline assembly); without an assembler that takes
# them, the library is built without them and the path is not offered (paths())
VNNI_ASM = "%{vex%} vpdpbusd %%ymm2, %%ymm1, %%ymm0"
FLAGS += [f"-DAVXVNNI_ASM={int(assembles(VNNI_ASM))}"]
# the paths, as quant.c numbers them: AVX2, AVX2 with AVX-VNNI (its vpdpbusd and vpdpwssd on ymm,
# VEX-encoded: Intel's client cores from Alder Lake on, AMD's Zen 5), AVX-512 VNNI
AVX2, AVXVNNI, AVX512 = 1, 2, 3
EXPERT_FIELDS = 12  # int64 fields of quant.c's expert_job
PRODUCT_FIELDS = 6  # int64 fields of quant.c's qproduct
TABLE_FIELDS = 7  # int64 fields per expert of hm_qmoe_tokens' table
# quant.c AMX_MIN_TOKENS: products of interleaved rows on AMX-INT8 tiles from here
TILES_FROM_TOKENS = 16

# name -> (argument types, result type), each under a copy of its C prototype in quant.c
SIGNATURES = {
    # int hm_qlinear(int fmt, const uint8_t *W, long ldw, long N, long K, const void *x, long ldx,
    #                int x_bf16, long M, float *Y, long ldy, int threads, int isa)
    "hm_qlinear": ([INT, P, N, N, N, P, N, INT, N, P, N, INT, INT], INT),
    # int hm_qlinear_many(const qproduct *p, long n, long K, const void *x, long ldx, int x_bf16,
    #                     long M, int threads, int isa)
    "hm_qlinear_many": ([P, N, N, P, N, INT, N, INT, INT], INT),
    # int hm_qexperts(const expert_job *e, long n, long H, long I, int x_bf16, int threads, int isa)
    "hm_qexperts": ([P, N, N, N, INT, INT, INT], INT),
    # int hm_quantize(int fmt, const float *x, long N, long K, uint8_t *out)
    "hm_quantize": ([INT, P, N, N, P], INT),
    # int hm_interleave(int fmt, uint8_t *W, long N, long K)
    "hm_interleave": ([INT, P, N, N], INT),
    # int hm_qrows(int fmt, const uint8_t *W, long ldw, long N, long K, const int64_t *ids, long n,
    #              void *out, int out_bf16)
    "hm_qrows": ([INT, P, N, N, N, P, N, P, INT], INT),
    # int hm_qmoe_tokens(const int64_t *experts, long E, const int64_t *ids, const float *w, long T,
    #                    long K, const void *x, int x_bf16, long H, long I, int threads, int isa,
    #                    void *out)
    "hm_qmoe_tokens": ([P, N, P, P, N, N, P, INT, N, N, INT, INT, P], INT),
    # void hm_set_amx8(int on): interleaved rows against many tokens on AMX-INT8 tiles
    "hm_set_amx8": ([INT], None),
    # void hm_pool_parallel(region_fn fn, void *arg, int T): the pool every library's regions
    # share (pool.h); not called from Python, its address handed to the others
    "hm_pool_parallel": ([P, P, INT], None),
}

PATH_NAMES = {"avx512": AVX512, "avxvnni": AVXVNNI, "avx2": AVX2, "off": 0}  # HYBRIDMOE_QUANT_ISA
_NEEDS = {
    AVX512: {"avx512_vnni", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    AVXVNNI: {"avx_vnni", "avx2", "fma", "f16c"},
    AVX2: {"avx2", "fma", "f16c"},
}


def paths() -> list[int]:
    """The paths this CPU runs, narrowest first (a CPU with AVX-512 VNNI may lack AVX-VNNI: Zen 4,
    Intel's Xeons before Sapphire Rapids)."""
    flags = cpu_flags()
    runs = [p for p in (AVX2, AVXVNNI, AVX512) if _NEEDS[p] <= flags]
    return [p for p in runs if p != AVXVNNI or "-DAVXVNNI_ASM=1" in FLAGS]


def best_isa() -> int:
    """The widest path this CPU runs: AVX512-VNNI (with BW, VL, DQ), else AVX2 with AVX-VNNI, else
    AVX2 (with FMA, F16C), else 0."""
    return max(paths(), default=0)


def isa() -> int:
    """The path in use: HYBRIDMOE_QUANT_ISA (avx512, avxvnni, avx2, off), or the widest below it
    that the CPU runs."""
    wanted = PATH_NAMES.get(env.quant_isa() or "", AVX512)
    return max([p for p in paths() if p <= wanted], default=0)


@lru_cache(maxsize=1)
def library():
    lib = load(SOURCE, FLAGS, SIGNATURES, HEADERS) if best_isa() else None
    if lib is not None:
        _bind(lib)
    return lib


def _bind(lib) -> None:
    """Hand the bf16 kernels' library, where it runs, this one's product (its attention block
    takes weights in blocks through it) and this one's worker pool, which the two libraries'
    kernels then share (pool.h says why)."""
    from hybridmoe.native import bf16  # imported here: bf16.py's kernels are not always wanted

    other = bf16.library()
    if other is not None:
        other.hm_bind_quant(
            ctypes.cast(lib.hm_qlinear, ctypes.c_void_p).value,
            ctypes.cast(lib.hm_qlinear_many, ctypes.c_void_p).value,
        )
        other.hm_share_pool(ctypes.cast(lib.hm_pool_parallel, ctypes.c_void_p).value)
    _TILES_ON[0] = bool(env.amx_enabled() and _tiles_permitted())
    lib.hm_set_amx8(int(_TILES_ON[0]))


_TILES_ON = [False]  # what quant.c's hm_set_amx8 was last told


def _tiles_permitted() -> bool:
    """Whether the CPU has AMX-INT8 tiles and Linux granted this process their state (asked
    through the bf16 library, which every AMX CPU runs: native/bf16.py)."""
    from hybridmoe.native import bf16

    other = bf16.library()
    return "amx_int8" in cpu_flags() and other is not None and bf16.amx_permitted(other)


def use_tiles(on: bool) -> bool:
    """Put many-token products of interleaved rows (Q4_K, Q5_K and Q6_K rows in eights, Q8_0, Q4_0
    and Q4_1 rows in sixteens) on the AMX-INT8 tiles or off them (quant.c amx_x8, amx_x16: the same
    bits as the VNNI path, faster); on only where the CPU has them and the process was granted them
    (HYBRIDMOE_AMX=0 starts with them off). Returns whether they are on now."""
    return switch(library(), "hm_set_amx8", _TILES_ON, on, _tiles_permitted)


def tiles_active() -> bool:
    """Whether many-token products of interleaved rows run on the AMX-INT8 tiles now."""
    library()
    return _TILES_ON[0]


def available() -> bool:
    return isa() > 0 and library() is not None


def _check(status: int, what: str) -> None:
    if status == -2:
        raise MemoryError(f"{what}: no memory for the quantised activations")
    if status == -3:
        raise IndexError(f"{what}: a row id is out of range")
    if status != 0:
        raise ValueError(
            f"{what}: the weight's format or width does not suit the kernel ({status})"
        )


def threads() -> int:
    """Threads a kernel call may use: torch's intra-op count (set by --threads), or what
    native/threads.py's kernels_only kept for the kernels."""
    return kernel_threads()


def linear(
    x: torch.Tensor,
    fmt: int,
    data: torch.Tensor,
    cols: int,
    path: int | None = None,
    workers: int | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32 or bf16, rows contiguous) times the weight [N, K] in blocks `data`
    [N, row bytes] of ggml type `fmt` -> [M, N] fp32, on `workers` threads (default threads())."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, rows = x.shape[0], data.shape[0]
    y = torch.empty(m, rows, dtype=torch.float32)  # [M, N]
    status = library().hm_qlinear(
        fmt,
        data.data_ptr(),
        data.stride(0),
        rows,
        cols,
        x.data_ptr(),
        x.stride(0),
        x.dtype == torch.bfloat16,
        m,
        y.data_ptr(),
        rows,
        workers or threads(),
        path or isa(),
    )
    _check(status, "quantised linear")
    return y


def linears(
    x: torch.Tensor,
    weights: list[tuple[int, torch.Tensor]],
    cols: int,
    path: int | None = None,
    workers: int | None = None,
) -> list[torch.Tensor]:
    """x [M, K] (fp32 or bf16, rows contiguous) times each weight [N_i, K] in blocks (ggml type,
    data [N_i, row bytes]) -> [M, N_i] fp32 each, the bits of `linear` on each, in one call: x
    quantised once per kind of activations the formats read, every product's rows shared out over
    `workers` threads together (default threads())."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m = x.shape[0]
    ys = [torch.empty(m, data.shape[0], dtype=torch.float32) for _, data in weights]  # [M, N_i]
    table = []
    for (fmt, data), y in zip(weights, ys):
        table += [fmt, data.data_ptr(), data.stride(0), data.shape[0], y.data_ptr(), y.shape[1]]
    products = torch.tensor(table, dtype=torch.int64)  # [n, PRODUCT_FIELDS]
    status = library().hm_qlinear_many(
        products.data_ptr(),
        len(weights),
        cols,
        x.data_ptr(),
        x.stride(0),
        x.dtype == torch.bfloat16,
        m,
        workers or threads(),
        path or isa(),
    )
    _check(status, "quantised linears")
    return ys


def experts(
    xs: list[torch.Tensor],
    weights: list[tuple],
    path: int | None = None,
    workers: int | None = None,
) -> list[torch.Tensor]:
    """SwiGLU experts in one call: expert j takes tokens xs[j] [M_j, H] (fp32 or bf16, all one
    dtype; the same tensor for several experts is quantised once) through weights[j] = (gate_up
    [2I, H], down [H, I]) QTensors -> [M_j, H] fp32 each. Gate and up are fused, h = silu(gate) *
    up is quantised once, and the work is spread over `workers` threads (default threads())."""
    hidden, inter = weights[0][1].shape
    xs = [x if x.stride(-1) == 1 else x.contiguous() for x in xs]
    ys = [torch.empty(x.shape[0], hidden, dtype=torch.float32) for x in xs]  # [M_j, H]
    table, copies = [], []  # copies: alive until the call returns
    for x, (gate_up, down), y in zip(xs, weights, ys):
        # gate and up rows may lie in two places (an expert viewed in the model file): the
        # kernel takes a pointer to each, with one row stride for both
        gate, up, dn = (
            gate_up.row_run(0, inter),
            gate_up.row_run(inter, inter),
            down.row_run(0, hidden),
        )
        if gate is None or up is None or gate[1] != up[1]:
            copies.append(gate_up.data.contiguous())  # [2I, row bytes]
            stride = copies[-1].stride(0)
            gate = (copies[-1].data_ptr(), stride)
            up = (gate[0] + inter * stride, stride)
        if dn is None:
            copies.append(down.data.contiguous())  # [H, row bytes]
            dn = (copies[-1].data_ptr(), copies[-1].stride(0))
        table += [gate[0], up[0], dn[0], gate[1], dn[1], gate_up.fmt.ggml, down.fmt.ggml]
        table += [x.data_ptr(), x.stride(0), x.shape[0], y.data_ptr(), 0]
    jobs = torch.tensor(table, dtype=torch.int64)  # [n, EXPERT_FIELDS]
    status = library().hm_qexperts(
        jobs.data_ptr(),
        len(xs),
        hidden,
        inter,
        xs[0].dtype == torch.bfloat16,
        workers or threads(),
        path or isa(),
    )
    _check(status, "quantised experts")
    return ys


def expert(
    x: torch.Tensor, gate_up, down, path: int | None = None, workers: int | None = 1
) -> torch.Tensor:
    """M tokens through one SwiGLU expert whose gate_up [2I, H] and down [H, I] are QTensors
    -> [M, H] fp32 (one thread unless told: a caller's worker pool runs experts side by side)."""
    return experts([x], [(gate_up, down)], path, workers)[0]


def expert_table(weights: list[tuple]) -> torch.Tensor | None:
    """moe_tokens' table [E, TABLE_FIELDS] for a layer's experts weights[e] = (gate_up [2I, H],
    down [H, I]) QTensors: each expert's gate, up and down addresses, row strides and formats; None
    where some expert's gate and up rows do not lie in one place each with one stride, or its down
    rows in one place (the table has one pointer each)."""
    rows = []
    for gate_up, down in weights:
        inter, hidden = down.shape[1], down.shape[0]
        gate, up = gate_up.row_run(0, inter), gate_up.row_run(inter, inter)
        dn = down.row_run(0, hidden)
        if gate is None or up is None or dn is None or gate[1] != up[1]:
            return None
        rows.append([gate[0], up[0], dn[0], gate[1], dn[1], gate_up.fmt.ggml, down.fmt.ggml])
    return torch.tensor(rows, dtype=torch.int64)  # [E, TABLE_FIELDS]


def moe_tokens(
    table: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    inter: int,
    workers: int,
    path: int | None = None,
) -> torch.Tensor:
    """Tokens x [T, H] (bf16 or fp32, contiguous: a decode token or a prefill chunk) through their
    routed experts and their weighted sums -> [T, H] in x's dtype: the bits of `experts` on each
    expert's tokens converted to x's dtype, then experts/run/ffn.py's combine_token (one token) or
    combine_grouped. x is quantised once for every expert. table: expert_table's; ids [T, K] int64
    and weights [T, K] fp32 as the router gives them (unsorted), contiguous."""
    tokens, hidden = x.shape
    out = torch.empty(tokens, hidden, dtype=x.dtype)  # [T, H]
    status = library().hm_qmoe_tokens(
        table.data_ptr(),
        table.shape[0],
        ids.data_ptr(),
        weights.data_ptr(),
        tokens,
        ids.shape[1],
        x.data_ptr(),
        x.dtype == torch.bfloat16,
        hidden,
        inter,
        workers,
        path or isa(),
        out.data_ptr(),
    )
    _check(status, "quantised experts of tokens")
    return out


def moe_tokens_entry() -> tuple[int, int]:
    """(hm_qmoe_tokens' address, the path it takes now: isa()) for a native caller of moe_tokens
    (bf16.c hm_decode_layers_bf16); (0, 0) where the kernels are not built."""
    lib = library()
    if lib is None:
        return 0, 0
    return ctypes.cast(lib.hm_qmoe_tokens, ctypes.c_void_p).value, isa()


def quantize(x: torch.Tensor, fmt: int, row_bytes: int) -> torch.Tensor:
    """fp32 rows [N, K] -> [N, row_bytes] uint8 blocks of ggml type `fmt` (Q8_0, Q4_0, Q4_K,
    Q6_K)."""
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], row_bytes, dtype=torch.uint8)
    status = library().hm_quantize(fmt, x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    _check(status, "quantising")
    return out


def interleave_rows(data: torch.Tensor, fmt: int, cols: int) -> None:
    """Q4_K, Q6_K, Q8_0 or Q4_0 rows (ggml type `fmt`) [N, row bytes] (N a multiple of the
    layout's 8 or 16 rows, contiguous) rearranged in place into their interleaved layout
    (quant/interleave.py; quant.c's hm_interleave says them byte by byte)."""
    _check(library().hm_interleave(fmt, data.data_ptr(), data.shape[0], cols), "interleaving rows")


def rows(
    data: torch.Tensor, fmt: int, cols: int, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` [n] (integers, 0 .. N-1) of the matrix in blocks `data` [N, row bytes] of ggml
    type `fmt` (not interleaved rows) -> their values [n, cols] in `dtype` (fp32 or bf16): the bits
    of quant/dequant.py's, in one call."""
    data = data if data.stride(-1) == 1 else data.contiguous()
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), cols, dtype=dtype)  # [n, K]
    status = library().hm_qrows(
        fmt,
        data.data_ptr(),
        data.stride(0),
        data.shape[0],
        cols,
        ids.data_ptr(),
        ids.numel(),
        out.data_ptr(),
        dtype == torch.bfloat16,
    )
    _check(status, f"looking up rows of a {data.shape[0]}-row matrix")
    return out
