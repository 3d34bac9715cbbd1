"""Test helper: write a GGUF file from a saved Hugging Face checkpoint, the way llama.cpp's
converter does.

It follows convert_hf_to_gguf.py's conventions, written afresh: gguf's own TensorNameMap for names,
experts stacked [E, rows, cols] per layer and role, Llama q/k rows permuted for GPT-J RoPE,
DeepSeek's kv_b_proj split into k_b (transposed) and v_b, and `{arch}.*` metadata from config.json.
The loader under test has its own reverse tables, so the two meet only through the file format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from hybridmoe.quant.tensor import QTensor

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {  # config.json model_type -> llama.cpp architecture
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
    "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2,
    "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
}
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)


def write_gguf(
    hf_dir: Path,
    out: Path,
    qtype: Q = Q.F32,
    drop: str | None = None,
    arch_name: str | None = None,
    legacy_experts: bool = False,
) -> Path:
    """Convert the checkpoint in `hf_dir` (config.json + model.safetensors) to the GGUF file `out`.
    `drop` leaves out the GGUF tensor of that name and `arch_name` overrides general.architecture
    (both for the bad-input tests); `legacy_experts` writes one tensor per expert,
    blk.N.ffn_up.E.weight, as llama.cpp did before it stacked them."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch_name or gguf.MODEL_ARCH_NAMES[arch])
    write_metadata(writer, cfg)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    dense = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"]
    )  # for dense MLP layers
    for hf_name, tensor in llama_cpp_tensors(load_file(str(hf_dir / "model.safetensors")), cfg):
        if legacy_experts and tensor.dim() == 3:
            _, layer, stack, _ = names.get_name(hf_name, try_suffixes=(".weight",)).split(".")
            for e, expert in enumerate(tensor):  # blk.0.ffn_up_exps -> blk.0.ffn_up.E
                name = f"blk.{layer}.{stack.removesuffix('_exps')}.{e}.weight"
                add_tensor(writer, name, expert.float().numpy(), qtype)
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias")) or dense.get_name(
            hf_name, try_suffixes=(".weight", ".bias")
        )
        assert name is not None, hf_name
        if name != drop:
            add_tensor(writer, name, tensor.float().numpy(), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q) -> None:
    """Norms, biases and (in block formats) routers stay F32, as llama.cpp keeps them; a matrix
    whose rows do not fill whole blocks falls back to F32 too."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    # llama.cpp's quantiser leaves routers F32 too
    router = block > 1 and name.endswith("ffn_gate_inp.weight")
    if data.ndim < 2 or qtype == Q.F32 or data.shape[-1] % block or router:
        writer.add_tensor(name, data.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    elif qtype in (
        Q.Q4_K,
        Q.Q6_K,
    ):  # gguf has no K-quant quantiser: hybridmoe's own writes the blocks
        blocks = QTensor.quantize(
            torch.from_numpy(data.reshape(-1, data.shape[-1])), qtype.name.lower()
        )
        writer.add_tensor(name, blocks.data.numpy().reshape(*data.shape[:-1], -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def llama_cpp_tensors(state: dict[str, torch.Tensor], cfg: dict):
    """(HF-style name that gguf's TensorNameMap knows, tensor) in llama.cpp's layout."""
    experts: dict[tuple[int, str, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((int(m[1]), m[2], m[4]), {})[int(m[3])] = t
            continue
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        if GGUF_ARCH[cfg["model_type"]] == gguf.MODEL_ARCH.LLAMA and re.search(
            r"\.(q|k)_proj\.(weight|bias)$", name
        ):
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            t = permute_rows(t, heads)
        if name.endswith("kv_b_proj.weight"):
            yield from split_kv_b(name, t, cfg)
            continue
        yield name.replace("e_score_correction_bias", "e_score_correction.bias"), t
    for (layer, block, role), per_expert in sorted(experts.items()):
        stacked = torch.stack([per_expert[e] for e in sorted(per_expert)])  # [E, rows, cols]
        yield f"model.layers.{layer}.{block}.experts.{role}.weight", stacked


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Per head, rows (2, D/2) -> (D/2, 2): the interleaved pairs of GPT-J RoPE that llama.cpp's
    llama uses."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def split_kv_b(name: str, w: torch.Tensor, cfg: dict):
    """kv_b_proj [H*(nope+v), rank] -> k_b [H, rank, nope] and v_b [H, v, rank],
    as newer converters write."""
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    k_b, v_b = w.view(heads, nope + v, w.shape[-1]).split([nope, v], dim=1)
    yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2).contiguous()
    yield name.replace("kv_b_proj", "v_b_proj"), v_b.contiguous()


def write_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
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
    write_rope_scaling(w, cfg)
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim") and not mla:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if (
        experts := cfg.get("num_local_experts")
        or cfg.get("num_experts")
        or cfg.get("n_routed_experts")
    ):
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if cfg.get("clip_qkv") is not None:
        w.add_clamp_kqv(cfg["clip_qkv"])
    if cfg["model_type"] == "qwen2_moe" and cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if mla:
        write_deepseek_metadata(w, cfg)


def write_rope_scaling(w: gguf.GGUFWriter, cfg: dict) -> None:
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


def write_deepseek_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """MLA written as llama.cpp's MQA form: head_count_kv 1,
    key/value_length of the compressed cache."""
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
    sigmoid = (
        cfg.get("scoring_func", "sigmoid" if cfg["model_type"] == "deepseek_v3" else "softmax")
        == "sigmoid"
    )
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
    )
