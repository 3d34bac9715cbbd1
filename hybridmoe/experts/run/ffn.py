"""The expert arithmetic, wherever it runs: one SwiGLU expert, tokens grouped by expert, and the
weighted sum of the chosen experts' outputs, always with the same reduction order (so that where an
expert ran never changes a bit of the result)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe import invariance, native, tuning
from hybridmoe.experts.run.store import ExpertWeights
from hybridmoe.native import quant as quant_kernels
from hybridmoe.native.threads import one_torch_thread
from hybridmoe.quant.tensor import QTensor, native_applies
from hybridmoe.quant.tensor import linear as qlinear


def expert_ffn(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """SwiGLU expert: down(silu(gate x) * up x). x: [n, H] -> [n, H].

    Experts in blocks take the integer kernels in one call (native/quant.c: gate and up fused, the
    product quantised once). Up to native.MAX_ROWS bf16 tokens (decode) go to the bf16 kernel
    wherever it runs (CPU runtime, pool, calibration): gate and up stay fp32 and silu(gate) * up is
    rounded to bf16 once. Either way a token's result does not depend on how many came with it.
    Otherwise F.linear, not layers/linear.py's oneDNN path: on worker threads oneDNN gave results
    7e-6 apart from the calling thread's, and an expert must not depend on where it runs."""
    if (
        isinstance(w.gate_up, QTensor)
        and isinstance(w.down, QTensor)
        and native_applies(x, w.gate_up, w.down)
    ):
        return quant_kernels.expert(x, w.gate_up, w.down).to(x.dtype)  # [n, H]
    if isinstance(w.gate_up, QTensor) or isinstance(w.down, QTensor):
        gate, up = qlinear(x, w.gate_up).chunk(2, dim=-1)  # [n, I] each
        return qlinear(F.silu(gate) * up, w.down)  # [n, H]
    if bf16_kernels_take(x, w.gate_up, w.down):
        return native.expert(x, w.gate_up, w.down).to(torch.bfloat16)  # [n, H]
    gate, up = F.linear(x.to(w.gate_up.dtype), w.gate_up).chunk(
        2, dim=-1
    )  # [n, I] each, views of [n, 2I]
    return F.linear(F.silu(gate) * up, w.down)  # [n, H]


def bf16_kernels_take(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether expert_ffn gives rows x [n, H] through bf16 weights to the bf16 kernels: up to
    native.MAX_ROWS (decode), any count where each row is computed as if alone
    (hybridmoe/invariance.py), so that a row's bits never depend on the rows beside it, or where
    oneDNN emulates bf16 (native.kernels_beat_onednn)."""
    every = invariance.active() or native.kernels_beat_onednn()
    rows = x.shape[0] if every else native.MAX_ROWS
    return native.applies(x, *weights, max_rows=rows)


def blocks_together(inputs: list[tuple[torch.Tensor, ExpertWeights]]) -> bool:
    """Whether experts_ffn takes these (rows, weights) pairs in one native call: all in blocks on
    the integer kernels, or all bf16 rows that expert_ffn would give the bf16 kernels (decode
    rows; any count where each row is computed as if alone, hybridmoe/invariance.py). The weights
    of one store are all of one kind, so the first pair's say which; each distinct row tensor is
    checked once."""
    kinds = {isinstance(w.gate_up, QTensor) and isinstance(w.down, QTensor) for _, w in inputs}
    if len(kinds) != 1:
        return False
    blocks, (x0, w) = kinds.pop(), inputs[0]
    checked = set()
    for x, _ in inputs:
        if id(x) in checked:
            continue
        if blocks:
            ok = x.dtype == x0.dtype and native_applies(x, w.gate_up, w.down)
        else:
            ok = bf16_kernels_take(x, w.gate_up, w.down)
        if not ok:
            return False
        checked.add(id(x))
    return True


def experts_ffn(
    inputs: list[tuple[torch.Tensor, ExpertWeights]], workers: int
) -> list[torch.Tensor]:
    """expert_ffn of each (rows [n, H], weights) pair, the same bits, all in one native call over
    `workers` threads (blocks_together must hold)."""
    xs, weights = [x for x, _ in inputs], [(w.gate_up, w.down) for _, w in inputs]
    if not isinstance(weights[0][0], QTensor):
        return native.experts(xs, weights, workers, torch.bfloat16)  # [n, H] each
    ys = quant_kernels.experts(xs, weights, workers=workers)
    return [y.to(x.dtype) for y, x in zip(ys, xs)]  # [n, H] each


def group_by_expert(topk_ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each expert used, (expert id, token rows, k columns) of its assignments.

    topk_ids: [T, K]. Returned in increasing expert id.
    """
    flat = topk_ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)  # [T*K]
    k = topk_ids.shape[1]
    # Rows and columns for all assignments at once, then sliced per expert: a `//` and a `%` per
    # expert would cost 128 small ops per layer at prefill.
    rows, cols = order // k, order % k  # [T*K] each
    counts = torch.bincount(flat).tolist()  # one sync per layer
    groups, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            groups.append((expert, rows[start : start + count], cols[start : start + count]))
            start += count
    return groups


def combine_grouped(
    x: torch.Tensor, groups, ys: list[torch.Tensor], topk_weights: torch.Tensor
) -> torch.Tensor:
    """The weighted sum [T, H] of the experts' outputs ys ([n, H] each, in the order of `groups`),
    in fp32, each token's terms added in increasing expert id.

    index_add_ adds its source rows in order, so one call for all experts is bit for bit the
    per-expert loop. One call is faster for a decode batch and slower for a prefill chunk, whose
    [T*K, H] terms outgrow the cache, which keeps the loop
    (docs/notes/2026-11-24-measurements-in-code.md, "FEW_TOKENS")."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    if x.shape[0] > tuning.FEW_TOKENS:
        with one_torch_thread(x.is_cpu):  # native/threads.py says why
            for (_, rows, cols), y in zip(groups, ys):
                out.index_add_(0, rows, y.float() * topk_weights[rows, cols, None].float())
        return out.to(x.dtype)
    rows = torch.cat([g[1] for g in groups])  # [T*K], grouped by expert
    cols = torch.cat([g[2] for g in groups])  # [T*K]
    terms = torch.cat(ys).float() * topk_weights[rows, cols, None].float()  # [T*K, H]
    return out.index_add_(0, rows, terms).to(x.dtype)


def combine_token(
    x: torch.Tensor, ys: list[torch.Tensor], topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """One token's weighted sum [1, H] of its K experts' outputs ys ([1, H] each, in top-k order,
    ids topk_ids [1, K]): each term y * w in fp32, added in increasing expert id, as
    combine_grouped adds them, so that a token decoded alone sums as it would in a batch."""
    ids = topk_ids[0].tolist()
    order = sorted(range(len(ys)), key=ids.__getitem__)
    terms = torch.cat([ys[k] for k in order]).float()  # [K, H]
    terms *= topk_weights[0, order].float()[:, None]
    # index_add_ adds its source rows in order: 0 + t_0 + t_1 + ..., the sum of the loop it
    # replaced (eight small torch calls a term)
    out = torch.zeros(x.shape, dtype=torch.float32)  # [1, H]
    return out.index_add_(0, torch.zeros(len(ys), dtype=torch.long), terms).to(x.dtype)


def combine(outputs: dict[int, torch.Tensor], groups, x, topk_ids, topk_weights) -> torch.Tensor:
    """The weighted sum [T, H] of expert outputs (expert id -> [n, H]), each token's terms added
    in increasing expert id (combine_token, combine_grouped)."""
    if x.shape[0] == 1:
        ys = [outputs[e] for e in topk_ids[0].tolist()]
        return combine_token(x, ys, topk_weights, topk_ids)
    return combine_grouped(x, groups, [outputs[expert] for expert, _, _ in groups], topk_weights)
