"""config.json -> the `{arch}.*` and `general.*` metadata llama.cpp reads, as its converter
(convert_hf_to_gguf.py) writes them; loader/gguf_config.py reads them back."""

from __future__ import annotations

import gguf

from hybridmoe.errors import UserError

# config.json model_type -> llama.cpp architecture (Mixtral is llama with experts)
ARCHITECTURES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
    "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2,
    "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
}
# llama.cpp's loaders of these refuse a file without output.weight: a tied head is written out
NEEDS_OUTPUT = {gguf.MODEL_ARCH.QWEN2MOE, gguf.MODEL_ARCH.OLMOE}


def architecture(cfg: dict) -> gguf.MODEL_ARCH:
    kind = cfg.get("model_type")
    if kind not in ARCHITECTURES:
        raise UserError(
            f"model_type {kind!r}: GGUF export knows {', '.join(sorted(ARCHITECTURES))}; "
            "export a model of one of them"
        )
    return ARCHITECTURES[kind]


def write_metadata(w: gguf.GGUFWriter, cfg: dict, file_type: int, name: str) -> None:
    """Everything but the tokenizer: general.* and the architecture's hyperparameters."""
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_file_type(file_type)
    if file_type != gguf.LlamaFileType.MOSTLY_BF16:
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    heads = cfg["num_attention_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    mla = cfg["model_type"].startswith("deepseek")  # MLA is written as MQA: one KV head
    w.add_head_count_kv(1 if mla else cfg.get("num_key_value_heads") or heads)
    w.add_rope_freq_base(
        cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    )
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _rope_scaling(w, cfg)
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim") and not mla:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    _experts(w, cfg)
    if cfg.get("clip_qkv") is not None:
        w.add_clamp_kqv(cfg["clip_qkv"])
    if mla:
        _deepseek(w, cfg)


def expert_count(cfg: dict) -> int:
    return (
        cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    )


def _experts(w: gguf.GGUFWriter, cfg: dict) -> None:
    if experts := expert_count(cfg):
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    # qwen3moe always renormalises in llama.cpp; qwen2moe never does (it ignores this key), but
    # hybridmoe reads it back, so a file of a renormalising Qwen2-MoE computes that model here
    if cfg["model_type"] == "qwen2_moe" and cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)


def _rope_scaling(w: gguf.GGUFWriter, cfg: dict) -> None:
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("mscale_all_dim") is not None:  # DeepSeek; llama.cpp has no separate mscale
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _deepseek(w: gguf.GGUFWriter, cfg: dict) -> None:
    """MLA written as llama.cpp's MQA form: head_count_kv 1, key/value_length of the compressed
    cache, the decompressed sizes in the *_mla keys."""
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_rope_dimension_count(rope)
    w.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 0))
    w.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    w.add_expert_weights_scale(cfg.get("routed_scaling_factor", 1.0))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    default = "sigmoid" if cfg["model_type"] == "deepseek_v3" else "softmax"
    sigmoid = cfg.get("scoring_func", default) == "sigmoid"
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    )
