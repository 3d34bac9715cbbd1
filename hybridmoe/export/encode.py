"""Float rows -> the bytes of a GGML type, for writing GGUF files.

Q8_0, Q4_0, Q4_K and Q6_K come from native/quant.c's quantisers (Q8_0 and Q4_0 bit-identical to
llama.cpp's reference quantiser; Q4_K and Q6_K a plain min/max fit, not llama.cpp's
importance-weighted search, so our K-quant files decode the same way but round differently);
Q5_0 and Q5_1 (llama.cpp's fallbacks for rows that do not fill 256-blocks) from gguf's reference
quantiser; Q5_K from `_q5_k` below, the same min/max fit as our Q4_K with 5-bit values."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from hybridmoe.errors import UserError
from hybridmoe.native import quant as kernels

Q = gguf.GGMLQuantizationType
_NATIVE = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K)


def nbytes(qtype: Q, shape: tuple[int, ...]) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return rows * (shape[-1] // block) * size


def encode(t: torch.Tensor, qtype: Q) -> np.ndarray:
    """Tensor [..., cols] -> its bytes in `qtype`, uint8 [rows, row bytes] (a flat view of
    elements for the float types)."""
    if qtype == Q.F32:
        return t.float().contiguous().numpy().view(np.uint8).reshape(-1)
    if qtype == Q.F16:
        return t.half().contiguous().numpy().view(np.uint8).reshape(-1)
    if qtype == Q.BF16:  # round to nearest even, as gguf's and torch's conversions both do
        return t.bfloat16().contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1)
    rows = t.reshape(-1, t.shape[-1]).float()  # [R, cols]
    if qtype in _NATIVE and kernels.library() is not None:  # the ISA switch picks kernels only
        return kernels.quantize(rows, int(qtype), nbytes(qtype, (1, rows.shape[1]))).numpy()
    if qtype == Q.Q5_K:
        return _q5_k(rows.numpy())
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        return gguf.quants.quantize(rows.numpy(), qtype)
    raise UserError(
        f"writing {qtype.name} needs hybridmoe's native quantiser, which does not run here "
        "(a CPU without AVX2, or no C compiler); export gguf-bf16 or gguf-q8_0"
    )


def _q5_k(x: np.ndarray) -> np.ndarray:
    """[R, cols] float32 -> [R, cols / 256 * 176] Q5_K: per block of 32 a scale (max - min) / 31 and
    a minimum (at most 0), both to 6 bits against the super-block's d and dmin."""
    rows = x.shape[0]
    v = x.reshape(-1, 8, 32).astype(np.float32)  # [S, 8 blocks, 32]
    lo, hi = np.minimum(v.min(-1), 0.0), v.max(-1)
    scale, mn = (hi - lo) / 31.0, -lo  # [S, 8]
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mn.max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.minimum(63, np.rint(scale / df)), 0).astype(np.uint8)
        m = np.where(dminf > 0, np.minimum(63, np.rint(mn / dminf)), 0).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((v + (dminf * m)[..., None]) / step), 0)
    q = np.clip(q, 0, 31).astype(np.uint8).reshape(-1, 256)  # [S, 256]
    out = np.empty((v.shape[0], 176), np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    out[:, 4:8] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    out[:, 8:12] = m[:, :4] | (m[:, 4:] >> 4) << 6
    out[:, 12:16] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    bits = (q.reshape(-1, 8, 32) >> 4) & 1  # [S, block j, element i]
    out[:, 16:48] = (bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
    low = (q & 15).reshape(-1, 4, 2, 32)  # group g: blocks 2g (low nibble), 2g+1 (high)
    out[:, 48:176] = (low[:, :, 0] | low[:, :, 1] << 4).reshape(-1, 128)
    return out.reshape(rows, -1)
