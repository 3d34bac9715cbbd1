"""Rotary position embeddings (RoPE), with the frequency scalings that Hugging Face configs name."""

from __future__ import annotations

import math

import torch

from hybridmoe.native import rows


def rope_parameters(cfg) -> dict:
    """rope_theta and rope_scaling from a config,
    old (rope_scaling) or new (rope_parameters) style."""
    params = dict(cfg.get("rope_parameters", default=None) or {})
    scaling = dict(cfg.get("rope_scaling", default=None) or {})
    params = {**scaling, **params}
    params.setdefault("rope_theta", cfg.get("rope_theta", default=10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = kind
    return params


def inv_frequencies(dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the attention scaling factor for this rope type."""
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]
    kind = params["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(params["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, params), 1.0
    if kind == "yarn":
        return _yarn(inv, dim, params)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def _llama3(inv: torch.Tensor, p: dict) -> torch.Tensor:
    # Llama 3.1 frequency-dependent scaling (Meta's reference implementation).
    factor, low, high = (
        float(p["factor"]),
        float(p["low_freq_factor"]),
        float(p["high_freq_factor"]),
    )
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor for a context extension of `scale`; DeepSeek also squares
    it into its softmax scale (mscale_all_dim)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv: torch.Tensor, dim: int, p: dict) -> tuple[torch.Tensor, float]:
    # YaRN (Peng et al. 2023): interpolate low frequencies, keep high ones, ramp in between.
    base, factor = float(p["rope_theta"]), float(p["factor"])
    old_len = float(p.get("original_max_position_embeddings") or 4096)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rot: float) -> float:
        return (dim * math.log(old_len / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):  # gpt-oss turns the rounding off
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    if p.get("attention_factor") is not None:
        attn = p["attention_factor"]
    elif mscale and mscale_all:
        attn = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    else:
        attn = yarn_mscale(factor)
    return inv, float(attn)


TABLE_POSITIONS = 8192  # positions Rotary keeps cos and sin of: 8 MB for 128-wide heads


class Rotary:
    """cos/sin tables for given positions; applies RoPE in the rotate-half (NeoX) layout."""

    def __init__(self, dim: int, params: dict):
        self.dim, self.params = dim, params
        self.inv_freq = None  # computed on first use: models are built on the meta device
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos_sin's: (cos, sin)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, dim] fp32 at `positions` [T]: rows of a table made for every position
        up to the largest asked for (doubling, up to TABLE_POSITIONS), so a decode step's one row
        is a view, not seven ops on caches its previous step's weights emptied; computed where a
        position is beyond. Every op is elementwise, so a row is the same bits whatever positions
        it was made with."""
        last = int(positions.max()) if positions.numel() else TABLE_POSITIONS
        if last >= TABLE_POSITIONS:
            return CosSin(self._make(positions))
        if (
            self._table is None
            or self._table[0].shape[0] <= last
            or self._table[0].device != positions.device
        ):
            size = min(max(256, 2 * (last + 1)), TABLE_POSITIONS)
            self._table = self._make(torch.arange(size, device=positions.device))
        cos, sin = self._table
        if positions.numel() == 1:
            return CosSin((cos[last : last + 1], sin[last : last + 1]))  # views: [1, dim]
        return CosSin((cos[positions], sin[positions]))

    def _make(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, dim] computed at positions [T]."""
        if self.inv_freq is None:
            with torch.device("cpu"):
                self.inv_freq, self.attention_scaling = inv_frequencies(self.dim, self.params)
        if self.inv_freq.device != positions.device:  # the model was placed on an accelerator
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, dim]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


class CosSin(tuple):
    """(cos, sin) [T, dim] fp32 of one pass, as Rotary makes them, with their copies in another
    dtype made once for all the layers of the pass: a training step's rotary computes in the
    activations' dtype, and its backward keeps the tables it multiplied by."""

    def cast(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) in `dtype`."""
        made = self.__dict__.setdefault("_cast", {})
        if dtype not in made:
            made[dtype] = tuple(t.to(dtype) for t in self)
        return made[dtype]


def tables(cos_sin, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin in `dtype`, once per pass where it is Rotary's."""
    if isinstance(cos_sin, CosSin):
        return cos_sin.cast(dtype)
    cos, sin = cos_sin
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, dim], cos/sin: [T, dim] -> [T, heads, dim]; bf16 rows outside training in one
    native call (native/rows.py) with the same roundings."""
    if rows.rotary_applies(x, cos):
        return rows.rotary(x, cos, sin)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin
