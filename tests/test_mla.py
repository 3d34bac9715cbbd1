"""MLA's two ways to attend — expanding the cached latents, or absorbing kv_b_proj into the queries
— are the same function."""

import torch

from hybridmoe.config import HFConfig
from hybridmoe.layers.attention import causal_attention
from hybridmoe.layers.mla import MLAttention
from hybridmoe.layers.rotary import Rotary, rope_parameters

CFG = HFConfig(
    dict(
        hidden_size=64,
        num_attention_heads=4,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        kv_lora_rank=32,
        q_lora_rank=None,
        rope_theta=10000.0,
    )
)


def test_absorbed_attention_equals_expanded_attention():
    torch.manual_seed(0)
    mla = MLAttention(CFG, 0, Rotary(8, rope_parameters(CFG)), interleaved=True)
    for n, L in [(1, 1), (1, 9), (3, 9), (9, 9)]:
        q_nope, q_pe = torch.randn(n, 4, 16), torch.randn(n, 4, 8)
        c_kv, k_pe = torch.randn(L, 32), torch.randn(L, 8)
        absorbed = mla._attend_absorbed(q_nope, q_pe, c_kv, k_pe)  # [n, h, v]
        k, v = mla._expand(c_kv, k_pe)
        expanded = causal_attention(torch.cat([q_nope, q_pe], dim=-1), k, v, mla.scale)
        assert absorbed.shape == (n, 4, 12)
        torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
