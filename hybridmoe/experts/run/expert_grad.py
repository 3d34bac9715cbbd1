"""The backward pass of a layer's routed experts, on the CPU, through the frozen store records.

`expert_layer` is the training form of a layer's expert computation: the same weighted sum as the
runtime's (experts/run/ffn.py), as a `torch.autograd.Function` whose backward gives the gradients of
the layer input, of the routing weights (the router learns nothing unless asked, but the loss still
reaches earlier layers through them) and of the experts' LoRA factors (experts/run/lora.py). The
frozen weights stay the store's records, in their dtype: autograd never sees them, so it never keeps
or upcasts a copy, and nothing of the size of an expert's weights is made.

What the forward keeps for the backward, per expert with n rows: its [gate; up] pre-activations
[n, 2I] and the LoRA's rank-r projections x A^T and h A^T [n, r]. The backward then costs two frozen
matmuls per expert (the input gradient through down and through gate_up), as many as the forward.
Everything computes in the store's dtype, the LoRA terms too (as under autocast: bf16 for a bf16
model); the outputs and the gradients are summed in fp32.

Experts kept in blocks (GGUF files, `quant=`) stay blocks: the forward runs on the integer kernels
as inference does (activations rounded to int8 per block), and the input gradient through them,
which those kernels cannot compute (quant/transposed.py says why), multiplies by a tile of
TRAIN_DEQUANT_ROWS dequantised rows at a time.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from hybridmoe import tuning
from hybridmoe.experts.run.cpu_pool import CPUExperts
from hybridmoe.experts.run.ffn import group_by_expert
from hybridmoe.experts.run.lora import ExpertLoRA, down, gate_up
from hybridmoe.experts.run.store import ExpertStore, ExpertWeights, Matrix
from hybridmoe.quant.tensor import QTensor
from hybridmoe.quant.transposed import times


@dataclass
class TrainLoRA:
    """A training step's expert LoRA for one layer (None: no expert is adapted; the gradient still
    flows through the experts to their input)."""

    lora: ExpertLoRA | None


class _NoLoRA(ExpertLoRA):
    """An ExpertLoRA without factors, so that the code has one path."""

    def __init__(self):
        super().__init__(1, 1, 1, 1, 1.0, matrices=())


_NONE = _NoLoRA()


def expert_layer(
    cpu: CPUExperts,
    store: ExpertStore,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    lora: ExpertLoRA | None,
) -> torch.Tensor:
    """x [T, H], topk_ids, topk_weights [T, K] -> [T, H]: the weighted sum of the chosen experts'
    outputs, differentiable in x, topk_weights and lora's factors. The experts run as jobs on the
    runtime's CPU workers (cpu_pool.py), one torch thread each, as inference runs them."""
    lora = lora or _NONE
    params = [p for m in ("gate_up", "down") for p in (lora.factors(m) or (None, None))]
    return _ExpertLayer.apply(x, topk_weights, *params, topk_ids, cpu, store, layer, lora)


@contextmanager
def _one_thread():
    """The layer's own small ops (gathers, sums) at one torch thread: on a shared 2-core machine a
    second OpenMP thread turned a 15 us index_add_ into 10 ms, waiting for a descheduled core
    (docs/notes/2026-11-24-finetune.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _normal(job):
    """A job whose tensors outlive it in autograd (the pool runs jobs in inference mode), recording
    nothing (a worker thread records by default; the Function computes its own gradients)."""

    def run():
        with torch.inference_mode(False), torch.no_grad():
            return job()

    return run


class _ExpertLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, gu_a, gu_b, d_a, d_b, topk_ids, cpu, store, layer, lora):
        groups = group_by_expert(topk_ids)
        dtype = store.dtype  # the experts compute in the store's dtype
        xs = x.to(dtype)  # [T, H]; blocks' products come out in their input's dtype
        f = (lora.cast("gate_up", dtype), lora.cast("down", dtype))
        jobs = [
            _normal(
                partial(
                    _expert_forward,
                    xs,
                    rows,
                    topk_weights[rows, cols, None],
                    store.get(layer, e),
                    f,
                    e,
                    lora.scaling,
                )
            )
            for e, rows, cols in groups
        ]
        batch = cpu.start(jobs, 0, heavy=True)
        out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        with _one_thread():
            results, _ = batch.result()
            for (_, rows, _), (y, _) in zip(groups, results):
                out.index_add_(0, rows, y)
        ctx.save_for_backward(x, topk_weights)
        ctx.cpu, ctx.store, ctx.layer, ctx.lora = cpu, store, layer, lora
        ctx.groups, ctx.kept = groups, [kept for _, kept in results]
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, topk_weights = ctx.saved_tensors
        lora, dtype = ctx.lora, ctx.store.dtype
        f = (lora.cast("gate_up", dtype), lora.cast("down", dtype))
        grad_out = grad_out.to(dtype)
        grads = {
            m: [torch.zeros_like(p) for p in fm] for m in lora.matrices if (fm := lora.factors(m))
        }  # each job adds into its own expert's rows of these
        jobs = [
            _normal(
                partial(
                    _expert_backward,
                    grad_out,
                    topk_weights[rows, cols, None].to(dtype),
                    kept,
                    x,
                    rows,
                    ctx.store.get(ctx.layer, e),
                    f,
                    e,
                    lora,
                    grads,
                )
            )
            for (e, rows, cols), kept in zip(ctx.groups, ctx.kept)
        ]
        batch = ctx.cpu.start(jobs, 0, heavy=True)
        dx = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        dw = torch.zeros(topk_weights.shape, dtype=torch.float32)  # [T, K]
        with _one_thread():
            results, _ = batch.result()
            for (_, rows, cols), (dx_e, dw_e) in zip(ctx.groups, results):
                dx.index_add_(0, rows, dx_e)
                dw[rows, cols] = dw_e
        ctx.kept = None
        flat = [t for m in ("gate_up", "down") for t in grads.get(m, (None, None))]
        return (dx.to(x.dtype), dw.to(topk_weights.dtype), *flat, None, None, None, None, None)


def _tiles(n: int) -> list[int]:
    """The row counts of the tiles that cover an expert's n rows: TRAIN_TILE_ROWS at a time, then
    the rest rounded up to TRAIN_ROW_GRAIN in powers of two (256, 128, ..., 8). oneDNN builds a
    bf16 matmul (a JIT kernel) for each row count it meets and keeps up to 1024 of them; one per
    expert group size held most of a demo training step's extra memory
    (docs/notes/2026-11-24-finetune.md, "Peak memory")."""
    tile, grain = tuning.TRAIN_TILE_ROWS, tuning.TRAIN_ROW_GRAIN
    rest = -(-n // grain) * grain  # n rounded up to a multiple of grain
    sizes = [tile] * (rest // tile)
    bit = tile // 2
    rest %= tile
    while rest:  # a multiple of grain below tile: its binary digits
        if rest & bit:
            sizes.append(bit)
            rest -= bit
        bit //= 2
    return sizes


def _padded(rows: torch.Tensor, wk: torch.Tensor | None = None):
    """rows [n] extended to the tiles' total [m] by repeating the last row, and the routing
    weights wk [n, 1] by zeros [m, 1]: a padding row adds nothing to any gradient."""
    extra = sum(_tiles(len(rows))) - len(rows)
    rows = torch.cat([rows, rows[-1:].expand(extra)])  # [m]
    if wk is None:
        return rows
    return rows, torch.cat([wk, wk.new_zeros(extra, 1)])  # [m, 1]


def _expert_forward(x, rows, wk, w: ExpertWeights, f, e: int, s: float):
    """One expert's rows, a tile at a time: its output [n, H] times the rows' routing weights wk
    [n, 1], in fp32 (weighted here, on the worker, rather than by the caller's one thread), and
    what its backward needs."""
    ys, kept, start = [], [], 0
    padded = _padded(rows)  # [m]
    for size in _tiles(len(rows)):
        y, k = _tile_forward(x[padded[start : start + size]], w, f, e, s)
        ys.append(y)
        kept.append(k)
        start += size
    y = torch.cat(ys)[: len(rows)].float()  # [n, H]
    return y.mul_(wk), kept


def _tile_forward(xt, w: ExpertWeights, f, e: int, s: float):
    """A tile's rows xt [t, H] through expert e: [t, H] and what its backward needs."""
    gu, xa = gate_up(xt, w, f[0], e, s)  # [t, 2I]
    gate, up = gu.chunk(2, dim=-1)
    y, ha = down(F.silu(gate) * up, w, f[1], e, s)  # [t, H]
    return y, (gu, xa, ha)


def _expert_backward(grad_out, wk, kept, x, rows, w: ExpertWeights, f, e, lora, grads):
    """One expert's rows, a tile at a time: grad_out = dLoss/d(layer output) [T, H], wk their
    routing weights [n, 1], what the forward kept per tile, f the LoRA factors (gate_up, down).
    Returns dx [n, H] and d(routing weight) [n]; adds the LoRA gradients into expert e's rows of
    `grads`."""
    padded, wk = _padded(rows, wk)  # [m], [m, 1]
    dxs, dws, start = [], [], 0
    for size, k in zip(_tiles(len(rows)), kept):
        t = padded[start : start + size]
        tile = slice(start, start + size)
        dx, dw = _tile_backward(grad_out[t], wk[tile], k, x[t], w, f, e, lora, grads)
        dxs.append(dx)
        dws.append(dw)
        start += size
    n = len(rows)
    return torch.cat(dxs)[:n].float(), torch.cat(dws)[:n].float()


def _back(g: torch.Tensor, w: Matrix) -> torch.Tensor:
    """g [t, out] @ w [out, in] -> [t, in]: the input gradient through a frozen store weight;
    blocks are dequantised a tile of rows at a time (quant/transposed.py), never the whole
    expert."""
    return times(g, w) if isinstance(w, QTensor) else g @ w


def _tile_backward(g, wk, kept, xt, w: ExpertWeights, f, e, lora, grads):
    """A tile's rows, in the store's dtype: g = dLoss/d(layer output) at its rows [t, H], wk their
    routing weights [t, 1] (0 on padding), what its forward kept, xt its inputs [t, H]. Returns dx
    [t, H] and d(routing weight) [t]; adds the LoRA gradients into expert e's rows of `grads`."""
    s, (f_gu, f_d) = lora.scaling, f
    gu, xa, ha = kept
    gate, up = gu.chunk(2, dim=-1)  # [t, I] each
    sig = torch.sigmoid(gate)
    sg = gate * sig  # silu(gate)
    h = sg * up  # [t, I]
    # y = down(h); dLoss/dy = wk * g. The routing weight's gradient is <g, y> = <g down, h>.
    dh = _back(g, w.down)  # [t, I]
    if f_d is not None:
        a, b = f_d[0][e], f_d[1][e]  # [r, I], [H, r]
        gb = g @ b  # [t, r]
        dh.addmm_(gb, a, alpha=s)
        da, db = grads["down"]
        da[e] += (s * (wk * gb).T @ h).float()  # [r, I]
        db[e] += (g.T @ (wk * ha)).float().mul_(s)  # [H, r]; scaled after: g.T is [H, t]
    dw = (dh * h).sum(dim=-1)  # [t]
    dh = dh * wk
    dgate = dh * up * sig * (1 + gate * (1 - sig))  # silu'(z) = sig(z) (1 + z (1 - sig(z)))
    dgu = torch.cat([dgate, dh * sg], dim=-1)  # [t, 2I]
    dx = _back(dgu, w.gate_up)  # [t, H]
    if f_gu is not None:
        a, b = f_gu[0][e], f_gu[1][e]  # [r, H], [2I, r]
        gb = dgu @ b  # [t, r]
        dx.addmm_(gb, a, alpha=s)
        da, db = grads["gate_up"]
        da[e] += (s * gb.T @ xt.to(gb.dtype)).float()  # [r, H]
        db[e] += (s * dgu.T @ xa).float()  # [2I, r]
    return dx, dw
