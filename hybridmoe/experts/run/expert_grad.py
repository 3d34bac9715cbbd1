"""The backward pass of a layer's routed experts, on the CPU, through the frozen store records.

`expert_layer` is the training form of a layer's expert computation: the same weighted sum as the
runtime's (experts/run/ffn.py), as a `torch.autograd.Function` whose backward gives the gradients of
the layer input, of the routing weights (the router learns nothing unless asked, but the loss still
reaches earlier layers through them) and of the experts' LoRA factors (experts/run/lora.py). The
frozen weights stay the store's records, in their dtype: autograd never sees them, so it never keeps
or upcasts a copy, and nothing of the size of an expert's weights is made.

What the forward keeps, per expert with n rows: its [gate; up] pre-activations [n, 2I] (in the
store's dtype) and the down LoRA's h A^T [n, r]. The backward then costs two frozen matmuls per
expert (the input gradient through down and through gate_up), as many as the forward. The frozen
products run in the store's dtype, a tile of rows at a time (_tiles: oneDNN keeps one kernel per row
count); the LoRA terms, the activations between the products and every sum run in fp32, as peft
computes its LoRA over bf16 activations. Each expert's rows are gathered once; gate_up's rank-r
products that touch x run once for the whole layer ([T, H] x [H, E r]).

Experts kept in blocks (GGUF files, `quant=`) stay blocks: the forward runs on the integer kernels
as inference does (activations rounded to int8 per block), and the input gradient through them,
which those kernels cannot compute (quant/transposed.py says why), multiplies by a tile of
TRAIN_DEQUANT_ROWS dequantised rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from hybridmoe import tuning
from hybridmoe.experts.run.cpu_pool import CPUExperts
from hybridmoe.experts.run.dense_experts import dense_applies, dense_experts
from hybridmoe.experts.run.ffn import group_by_expert
from hybridmoe.experts.run.lora import ExpertLoRA, frozen
from hybridmoe.experts.run.store import ExpertStore, ExpertWeights, Matrix
from hybridmoe.native.threads import one_torch_thread
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
    dense: bool | None = None,
) -> torch.Tensor:
    """x [T, H], topk_ids, topk_weights [T, K] -> [T, H]: the weighted sum of the chosen experts'
    outputs, differentiable in x, topk_weights and lora's factors. The experts run as jobs on the
    runtime's CPU workers (cpu_pool.py), one torch thread each, as inference runs them; or, where
    tokens choose a large share of the layer's experts (`dense`, by default dense_applies), every
    expert for every token in a few large products on the calling thread (dense_experts.py)."""
    lora = lora or _NONE
    params = [p for m in ("gate_up", "down") for p in (lora.factors(m) or (None, None))]
    if dense is None:
        dense = dense_applies(store, layer, topk_ids.shape[1])
    if dense:
        return dense_experts(store, layer, x, topk_ids, topk_weights, *params, lora.scaling)
    return _ExpertLayer.apply(x, topk_weights, *params, topk_ids, cpu, store, layer, lora)


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
        f = _Factors(gu_a, gu_b, d_a, d_b, lora.scaling, store.dtype)
        xs = x.to(f.dtype)  # [T, H]; blocks' products come out in their input's dtype
        xa = f.layer_in(x.float())  # [T, E, r] or None
        jobs = [
            _normal(
                partial(
                    _expert_forward, xs, xa, rows, topk_weights[rows, cols, None].float(),
                    store.get(layer, e), f, e,
                )
            )
            for e, rows, cols in groups
        ]  # fmt: skip
        batch = cpu.start(jobs, 0, heavy=True)
        out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        with one_torch_thread():
            results, _ = batch.result()
            for (_, rows, _), (y, _) in zip(groups, results):
                out.index_add_(0, rows, y)
        ctx.save_for_backward(x, topk_weights)
        ctx.cpu, ctx.store, ctx.layer, ctx.f = cpu, store, layer, f
        ctx.groups, ctx.kept = groups, [kept for _, kept in results]
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, topk_weights = ctx.saved_tensors
        f = ctx.f
        xf = x.float()  # [T, H]
        xa = f.layer_in(xf)  # [T, E, r] or None: made again rather than kept
        grads = f.zero_grads()
        gb = torch.zeros(len(x), *f.gu_a.shape[:2]) if f.gate_up else None  # [T, E, r]
        jobs = [
            _normal(
                partial(
                    _expert_backward, grad_out, topk_weights[rows, cols, None].float(), kept, xa,
                    rows, ctx.store.get(ctx.layer, e), f, e, grads, gb,
                )
            )
            for (e, rows, cols), kept in zip(ctx.groups, ctx.kept)
        ]  # fmt: skip
        batch = ctx.cpu.start(jobs, 0, heavy=True)
        dx = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        dw = torch.zeros(topk_weights.shape, dtype=torch.float32)  # [T, K]
        with one_torch_thread():
            results, _ = batch.result()
            for (_, rows, cols), (dx_e, dw_e) in zip(ctx.groups, results):
                dx.index_add_(0, rows, dx_e)
                dw[rows, cols] = dw_e
        ctx.kept = None
        if gb is not None:
            f.gate_up_in_grads(gb, xf, dx, grads[0])
        grads = f.grads_out(grads)
        return (dx.to(x.dtype), dw.to(topk_weights.dtype), *grads, None, None, None, None, None)


@dataclass
class _Factors:
    """A layer's expert LoRA factors as the Function got them (fp32 parameters; None where a matrix
    is not targeted), and the dtype of the frozen products. The LoRA terms compute in fp32, as
    peft computes them over bf16 activations; the frozen products in the store's dtype."""

    gu_a: torch.Tensor | None  # [E, r, H]
    gu_b: torch.Tensor | None  # [E, 2I, r]
    d_a: torch.Tensor | None  # [E, r, I]
    d_b: torch.Tensor | None  # [E, H, r]
    scaling: float
    dtype: torch.dtype

    @property
    def gate_up(self):
        return None if self.gu_a is None else (self.gu_a, self.gu_b)

    @property
    def down(self):
        return None if self.d_a is None else (self.d_a, self.d_b)

    def layer_in(self, xf: torch.Tensor) -> torch.Tensor | None:
        """x A_e^T of gate_up's LoRA for every token and every expert, xf [T, H] -> [T, E, r]: one
        product for the layer (twice the multiply-adds of the chosen experts' alone, one call
        rather than one per expert and tile)."""
        if self.gu_a is None:
            return None
        e, r, h = self.gu_a.shape
        return (xf @ self.gu_a.reshape(e * r, h).T).view(-1, e, r)  # [T, E, r]

    def zero_grads(self) -> list[torch.Tensor | None]:
        """Zero gradients for (gu_a, gu_b, d_a, d_b), the B's transposed ([E, r, out]: made as
        [r, out] per expert, see "rank first"); each expert's job fills its own rows."""
        ps = (self.gu_a, self.gu_b, self.d_a, self.d_b)
        return [
            None if p is None else torch.zeros(p.shape if i % 2 == 0 else p.transpose(1, 2).shape)
            for i, p in enumerate(ps)
        ]

    @staticmethod
    def grads_out(grads) -> list[torch.Tensor | None]:
        """zero_grads' tensors, filled, as the parameters' gradients (B's as [E, out, r])."""
        return [g if g is None or i % 2 == 0 else g.transpose(1, 2) for i, g in enumerate(grads)]

    def gate_up_in_grads(self, gb, xf, dx, grad_a) -> None:
        """The gate_up LoRA's part of the input gradient and its A gradient for the whole layer:
        gb [T, E, r] = dLoss/d(gate_up) B_e at each token's chosen experts (zero elsewhere), xf
        [T, H]; dx [T, H] += s gb A, grad_a [E, r, H] = s gb^T x."""
        e, r, h = self.gu_a.shape
        gb = gb.view(-1, e * r)  # [T, E r]
        dx.addmm_(gb, self.gu_a.reshape(e * r, h), alpha=self.scaling)
        grad_a.view(e * r, h).addmm_(gb.T, xf, alpha=self.scaling)


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


def _expert_forward(xs, xa, rows, wk, w: ExpertWeights, f: _Factors, e: int):
    """One expert's rows (gathered once, then a tile at a time through the frozen weights): its
    output [n, H] times the rows' routing weights wk [n, 1], in fp32 (weighted here, on the worker,
    rather than by the caller's one thread), and what its backward needs."""
    n, s = len(rows), f.scaling
    padded = _padded(rows)  # [m]
    gu = _through(xs[padded], w.gate_up).float()  # [m, 2I]
    if f.gate_up:
        gu.addmm_(xa[padded, e], f.gu_b[e].T, alpha=s)  # [m, r] @ [r, 2I]
    gate, up = gu.chunk(2, dim=-1)  # [m, I] each
    h = F.silu(gate) * up  # [m, I]
    y = _through(h.to(f.dtype), w.down)[:n].float()  # [n, H]
    ha = None
    if f.down:
        ha = (f.d_a[e] @ h.T).T  # [m, r], made as [r, m] (rank first)
        y.addmm_(ha[:n], f.d_b[e].T, alpha=s)
    return y.mul_(wk), (gu.to(f.dtype), ha)


def _through(x: torch.Tensor, w: Matrix) -> torch.Tensor:
    """x [m, in] through a frozen store weight [out, in] -> [m, out], a tile of rows at a time
    (m is a sum of _tiles)."""
    return _by_tiles(x, lambda t: frozen(t, w))


def _back(g: torch.Tensor, w: Matrix) -> torch.Tensor:
    """g [m, out] @ w [out, in] -> [m, in], a tile of rows at a time: the input gradient through a
    frozen store weight; blocks are dequantised a tile of rows at a time (quant/transposed.py),
    never the whole expert."""
    return _by_tiles(g, lambda t: times(t, w) if isinstance(w, QTensor) else t @ w)


def _by_tiles(x: torch.Tensor, product) -> torch.Tensor:
    """product of x's rows, a tile of _tiles(len(x)) rows at a time, the tiles' results stacked."""
    ys, start = [], 0
    for size in _tiles(len(x)):
        ys.append(product(x[start : start + size]))
        start += size
    return ys[0] if len(ys) == 1 else torch.cat(ys)


# Rank first: the fp32 products whose result has r (rank) columns and many rows run as their
# transpose, [r, m] rather than [m, r]: the CPU's sgemm is several times slower with so few output
# columns (docs/notes/2026-11-25-finetune-expert-overhead.md).


def _expert_backward(g, wk, kept, xa, rows, w: ExpertWeights, f: _Factors, e, grads, gb):
    """One expert's rows: g = dLoss/d(layer output) [T, H], wk the rows' routing weights [n, 1],
    what the forward kept. Returns dx [n, H] through the frozen
    weights and the down LoRA, and d(routing weight) [n]; writes expert e's LoRA gradients into
    `grads` and its dLoss/d(gate_up) B_e into gb [T, E, r] (_Factors.gate_up_in_grads does the
    rest for the whole layer)."""
    n, s = len(rows), f.scaling
    padded, wk = _padded(rows, wk)  # [m], [m, 1] (0 on padding: it adds to no gradient)
    ge = g[padded]  # [m, H], gathered in g's dtype (bf16 in a bf16 step: half the bytes)
    gu, ha = kept
    gate, up = gu.float().chunk(2, dim=-1)  # [m, I] each
    sig = torch.sigmoid(gate)
    sg = gate * sig  # silu(gate)
    h = sg * up  # [m, I]
    # y = down(h); dLoss/dy = wk * g. The routing weight's gradient is <g, y> = <g down, h>.
    dh = _back(ge.to(f.dtype), w.down).float()  # [m, I]
    if f.down:
        ge = ge.float()  # the LoRA products in fp32
        gdb = (f.d_b[e].T @ ge.T).T  # [m, r], made as [r, m] (rank first)
        dh.addmm_(gdb, f.d_a[e], alpha=s)
        grads[2][e].addmm_((gdb * wk).T, h, alpha=s)  # [r, I]
        grads[3][e].addmm_((ha * wk).T, ge, alpha=s)  # [r, H]: B's gradient transposed
    dw = (dh * h).sum(dim=-1)  # [m]
    dh.mul_(wk)
    dgate = dh * up * sig * (1 + gate * (1 - sig))  # silu'(z) = sig(z) (1 + z (1 - sig(z)))
    dgu = torch.cat([dgate, dh * sg], dim=-1)  # [m, 2I]
    dx = _back(dgu.to(f.dtype), w.gate_up)[:n].float()  # [n, H]
    if f.gate_up:
        gbe = (f.gu_b[e].T @ dgu.T).T  # [m, r], made as [r, m] (rank first)
        gb[:, e].index_put_((rows,), gbe[:n])
        grads[1][e].addmm_(xa[padded, e].T, dgu, alpha=s)  # [r, 2I]: B's gradient transposed
    return dx, dw[:n]
