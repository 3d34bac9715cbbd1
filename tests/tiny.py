"""Tiny random-weight models built with transformers' own classes: the reference for parity
tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(**TINY_COMMON, intermediate_size=96, tie_word_embeddings=True)
    )


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            **TINY_COMMON,
            intermediate_size=48,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        )
    )


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # 3 layers: layer 0 dense (mlp_only_layers), 1 and 2 sparse; head_dim 32 != hidden / heads
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **{**TINY_COMMON, "num_hidden_layers": 3},
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            tie_word_embeddings=False,
        )
    )


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    # clip_qkv low enough that some q/k/v values are clamped
    return OlmoeForCausalLM(
        OlmoeConfig(
            **{**TINY_COMMON, "rms_norm_eps": 1e-5},
            intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            clip_qkv=1.0,
            pad_token_id=0,
            eos_token_id=1,
            tie_word_embeddings=False,
        )
    )


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    # 4 layers, decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense; biases on q/k/v only
    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **{**TINY_COMMON, "num_hidden_layers": 4},
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        )
    )


# DeepSeek: MLA (nope 8 + rope 8 query/key dims, values 12), YaRN with mscale != mscale_all_dim so
# that both the cos/sin factor and the softmax scale matter; layer 0 dense, 1-2 MoE with a shared
# expert; 8 experts in 4 groups of which 2 are kept, so group-limited routing changes choices.
DEEPSEEK_COMMON = dict(
    **{**TINY_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=1.5,
    tie_word_embeddings=False,
    rope_scaling=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=8.0,
        original_max_position_embeddings=32,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=0.8,
    ),
)


def _deepseek_v2():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    # V2 scores a group by its best expert: with one group kept, both experts come from it
    cfg = DeepseekV2Config(
        **{**DEEPSEEK_COMMON, "topk_group": 1},
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        norm_topk_prob=False,
    )
    return DeepseekV2ForCausalLM(cfg)


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(
        DeepseekV3Config(
            **DEEPSEEK_COMMON, q_lora_rank=24, norm_topk_prob=True, rope_interleave=True
        )
    )
    with torch.no_grad():  # a load-balancing bias that changes choices (sigmoid scores lie in 0..1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.2)
    return model


BUILDERS = {
    "llama": _llama,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "qwen2_moe": _qwen2_moe,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
}


def build_tiny(arch: str, out: Path, seed: int = 0):
    """Save a tiny random `arch` model (fp32) into `out`; return the transformers model."""
    torch.manual_seed(seed)
    model = BUILDERS[arch]().float().eval()
    with torch.no_grad():  # spread router and norm weights so that routing and norms matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".gate.weight") or "router" in name:
                p.normal_(0, 0.5)
            elif (
                name.endswith(".bias") or "shared_expert_gate" in name
            ):  # HF initialises these to ~0
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    return model


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """All-position fp32 logits [n, V] of the transformers reference model."""
    return model(torch.tensor([ids])).logits[0].float()


def bf16_batch_greedy(arch: str, out: Path):
    """A tiny bf16 `arch` model built in `out`, and a function that runs six prompts (1 to 40
    tokens) through the batching engine with chunked prefill, greedily: to compare a kernel on and
    off."""
    from hybridmoe.loader import load_model

    build_tiny(arch, out, seed=3)
    return batch_greedy(load_model(out, dtype=torch.bfloat16, progress=False))


def batch_greedy(model):
    """bf16_batch_greedy's runner for a model already loaded (a GGUF file's, say)."""
    from hybridmoe.engine.config import EngineConfig
    from hybridmoe.engine.llm_engine import LLMEngine
    from hybridmoe.engine.sampler import SamplingParams

    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (1, 5, 17, 33, 9, 40)]

    def generate() -> list[list[int]]:
        eng = LLMEngine(
            model,
            None,
            # the fastest kernel per pass (not batch invariance, which attends every prompt
            # token through the decode kernel): the prefill kernel is what is compared
            EngineConfig(
                block_size=4, max_batch_size=4, max_tokens_per_step=24, deterministic=False
            ),
            eos_ids=(),
        )
        return eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0), max_steps=500)

    return generate


def tiny_models(tmp_path_factory):
    """A getter arch -> directory of that tiny model, each built once (a module fixture's body)."""
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = tmp_path_factory.mktemp(arch) / "model"
            build_tiny(arch, made[arch])
        return made[arch]

    return get


def build_wide_mixtral(out, spread_norms: bool = False) -> None:
    """A tiny Mixtral 256 wide, so that every matrix fills whole K-quant blocks of 256; routers
    spread (N(0, 0.5)) and, with spread_norms, norm weights drawn from U(0.5, 1.5)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        **{**TINY_COMMON, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
        intermediate_size=256,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if spread_norms and name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
