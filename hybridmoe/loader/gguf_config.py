"""GGUF metadata -> the Hugging Face config.json keys our models read.

llama.cpp's converter (convert_hf_to_gguf.py) writes `{arch}.<key>` metadata from config.json; this
undoes it per architecture. What the metadata leaves out (which layers are dense, tied embeddings,
the vocabulary size) is read off the tensor list, which is what llama.cpp itself does.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridmoe.errors import ModelFileError

Shapes = dict[str, tuple[int, ...]]  # GGUF tensor name -> torch-order shape


class Meta:
    """`{arch}.<key>` lookups in a GGUF metadata dict;
    `need` names the file when a key is missing."""

    def __init__(self, meta: dict, arch: str, where: str):
        self.meta, self.arch, self.where = meta, arch, where

    def get(self, key: str, default=None):
        value = self.meta.get(f"{self.arch}.{key}")
        return default if value is None else value

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelFileError(
                f"{self.where}: GGUF metadata has no {self.arch}.{key}; the file is incomplete"
            )
        return value


def hf_config(meta: dict, shapes: Shapes, where: str) -> dict:
    """The config.json dict of the model in a GGUF file with metadata `meta` and tensors
    `shapes`."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFileError(
            f"{where}: GGUF architecture {arch!r} is not supported; "
            f"supported are {', '.join(sorted(ARCHITECTURES))}"
        )
    m = Meta(meta, arch, where)
    cfg = _common(m, meta, shapes)
    cfg.update(ARCHITECTURES[arch](m, shapes))
    return cfg


def _common(m: Meta, meta: dict, shapes: Shapes) -> dict:
    if "token_embd.weight" not in shapes:
        raise ModelFileError(f"{m.where}: no token_embd.weight tensor; the GGUF file is incomplete")
    heads = m.need("attention.head_count")
    cfg = {
        "hidden_size": m.need("embedding_length"),
        "num_hidden_layers": m.need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.get("attention.head_count_kv", heads),
        "intermediate_size": m.get("feed_forward_length"),
        "rms_norm_eps": m.get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": m.get("rope.freq_base", 10000.0),
        "max_position_embeddings": m.get("context_length", 4096),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,  # llama.cpp drops a tied lm_head
        "rope_scaling": _rope_scaling(m),
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if (value := meta.get(f"tokenizer.ggml.{key}")) is not None:
            cfg[key.replace("padding", "pad")] = value
    return cfg


def _rope_scaling(m: Meta) -> dict | None:
    kind = m.get("rope.scaling.type")
    if kind is None and m.get("rope.scale_linear", 1.0) != 1.0:  # older files
        return {"rope_type": "linear", "factor": m.get("rope.scale_linear")}
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": m.need("rope.scaling.factor")}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = m.get("rope.scaling.original_context_length")
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := m.get(f"rope.scaling.{key}")) is not None:
                scaling[hf] = value
        if (log_mul := m.get("rope.scaling.yarn_log_multiplier")) is not None:
            # DeepSeek: the converter writes 0.1 * mscale_all_dim;
            # mscale equals it in V2 and V3 configs
            scaling["mscale"] = scaling["mscale_all_dim"] = round(log_mul / 0.1, 6)
    return scaling


def _dense_layers(m: Meta, shapes: Shapes) -> list[int]:
    """Layers without a router: llama.cpp marks MoE layers only by their ffn_gate_inp tensor."""
    return [i for i in range(m.need("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in shapes]


def _head_dim(m: Meta) -> int:
    return m.get("attention.key_length") or m.need("embedding_length") // m.need(
        "attention.head_count"
    )


def _llama(m: Meta, shapes: Shapes) -> dict:
    experts = m.get("expert_count", 0)
    if not experts:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "head_dim": _head_dim(m),
        }
    # llama.cpp stores Mixtral as arch llama with experts;
    # its feed_forward_length is the expert's size
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "head_dim": _head_dim(m),
        "intermediate_size": m.get("feed_forward_length") or m.need("expert_feed_forward_length"),
        "num_local_experts": experts,
        "num_experts_per_tok": m.need("expert_used_count"),
    }


def _qwen_moe(m: Meta, shapes: Shapes, norm_topk_default: bool) -> dict:
    return {
        "num_experts": m.need("expert_count"),
        "num_experts_per_tok": m.need("expert_used_count"),
        "moe_intermediate_size": m.need("expert_feed_forward_length"),
        "norm_topk_prob": bool(m.get("expert_weights_norm", norm_topk_default)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": _dense_layers(m, shapes),
    }


def _qwen3moe(m: Meta, shapes: Shapes) -> dict:
    # llama.cpp's qwen3moe always renormalises the top-k weights (norm_w = true in qwen3moe.cpp)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": _head_dim(m),
        **_qwen_moe(m, shapes, norm_topk_default=True),
    }


def _qwen2moe(m: Meta, shapes: Shapes) -> dict:
    shared = m.get("expert_shared_feed_forward_length")
    if shared is None and "blk.0.ffn_up_shexp.weight" in shapes:
        shared = shapes["blk.0.ffn_up_shexp.weight"][0]
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "shared_expert_intermediate_size": shared,
        **_qwen_moe(m, shapes, norm_topk_default=False),
    }


def _olmoe(m: Meta, shapes: Shapes) -> dict:
    return {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "intermediate_size": m.get("expert_feed_forward_length") or m.need("feed_forward_length"),
        "num_experts": m.need("expert_count"),
        "num_experts_per_tok": m.need("expert_used_count"),
        "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
        "clip_qkv": m.get("attention.clamp_kqv"),
    }


def _deepseek2(m: Meta, shapes: Shapes) -> dict:
    """DeepSeek-V2 and V3 share llama.cpp's deepseek2;
    V3 is the one with sigmoid scores and a score bias."""
    rope_dim = m.need("rope.dimension_count")
    if (
        m.get("attention.key_length_mla") is not None
    ):  # newer files: key/value_length describe the MQA form
        qk_head, v_head = m.need("attention.key_length_mla"), m.need("attention.value_length_mla")
    else:
        qk_head, v_head = m.need("attention.key_length"), m.need("attention.value_length")
    score_bias = any(name.endswith("exp_probs_b.bias") for name in shapes)
    gating = m.get("expert_gating_func")  # 1 softmax, 2 sigmoid; older V3 files leave it out
    sigmoid = gating == 2 or (gating is None and score_bias)
    v3 = sigmoid or score_bias
    n_group = m.get("expert_group_count", 1)
    heads = m.need("attention.head_count")
    return {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        # the converter writes 1 (MLA as MQA); HF counts the decompressed heads
        "num_key_value_heads": heads,
        "q_lora_rank": m.get("attention.q_lora_rank"),
        "kv_lora_rank": m.need("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head - rope_dim,
        "v_head_dim": v_head,
        "head_dim": rope_dim,
        # llama.cpp's deepseek2 always rotates interleaved pairs, as HF's V2 does
        "rope_interleave": True,
        "moe_intermediate_size": m.need("expert_feed_forward_length"),
        "n_routed_experts": m.need("expert_count"),
        "num_experts_per_tok": m.need("expert_used_count"),
        "n_shared_experts": m.get("expert_shared_count", 0),
        "first_k_dense_replace": m.get("leading_dense_block_count", 0),
        "moe_layer_freq": 1,
        "routed_scaling_factor": m.get("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
        "n_group": n_group,
        "topk_group": m.get("expert_group_used_count", 1),
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if n_group > 1 else "greedy"),
    }


ARCHITECTURES: dict[str, Callable[[Meta, Shapes], dict]] = {
    "llama": _llama,
    "qwen3moe": _qwen3moe,
    "qwen2moe": _qwen2moe,
    "olmoe": _olmoe,
    "deepseek2": _deepseek2,
}
