"""A benchmark model's tensors made on demand from seeded random numbers: an export source
(export/sources.py) that never holds the model, so a full-depth Qwen3-30B-A3B file is written one
expert at a time.

Values: norms 1, everything else N(0, 0.02) (transformers' initialisation), each row a window of
one shared pool of 4M normal numbers at a start drawn from a generator seeded by the model's seed
and the tensor's name: the same tensor every time, at memory-copy speed instead of a normal
generator's (~50 M values/s here; the full-depth model has 29 G)."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from hybridmoe.bench.model import SHAPES

POOL = 1 << 22


class RandomSource:
    def __init__(self, shape: str, layers: int, seed: int, tokenizer_dir: Path | None):
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(**SHAPES[shape], num_hidden_layers=layers).to_dict()
        cfg["architectures"] = ["Qwen3MoeForCausalLM"]
        self.config = cfg
        self.shapes = qwen3_moe_shapes(cfg)
        self.tokenizer_dir = tokenizer_dir
        self.name = f"random {shape} {layers} layers seed {seed}"
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self._pool = torch.randn(POOL, generator=gen) * cfg.get("initializer_range", 0.02)  # [POOL]

    def read(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        cols, rows = shape[-1], int(torch.Size(shape[:-1]).numel())
        gen = torch.Generator().manual_seed(self.seed << 32 | zlib.crc32(name.encode()))
        starts = torch.randint(0, POOL - cols + 1, (rows,), generator=gen)  # [rows]
        return self._pool.unfold(0, cols, 1).index_select(0, starts).reshape(shape)  # [.., cols]


def qwen3_moe_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3-MoE checkpoint as transformers saves it (one tensor per expert)."""
    hidden, vocab, head = c["hidden_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    inner, experts = c["moe_intermediate_size"], c.get("num_experts") or c["num_local_experts"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q, hidden),
            f"{p}.self_attn.k_proj.weight": (kv, hidden),
            f"{p}.self_attn.v_proj.weight": (kv, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, q),
            f"{p}.self_attn.q_norm.weight": (head,),
            f"{p}.self_attn.k_norm.weight": (head,),
            f"{p}.mlp.gate.weight": (experts, hidden),
        }
        for e in range(experts):
            shapes |= {
                f"{p}.mlp.experts.{e}.gate_proj.weight": (inner, hidden),
                f"{p}.mlp.experts.{e}.up_proj.weight": (inner, hidden),
                f"{p}.mlp.experts.{e}.down_proj.weight": (hidden, inner),
            }
    return shapes | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
