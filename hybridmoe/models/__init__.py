"""One file per architecture; this registry maps config.json's architecture to its class."""

from __future__ import annotations

import importlib

from hybridmoe.config import HFConfig
from hybridmoe.errors import ModelFileError

# architecture (config.json "architectures"[0] or model_type) -> (module, class)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}


def model_class(cfg: HFConfig, where: str = "config.json"):
    for key in (cfg.architecture, cfg.model_type):
        if key in ARCHITECTURES:
            module, name = ARCHITECTURES[key]
            return getattr(importlib.import_module(f"hybridmoe.models.{module}"), name)
    supported = sorted(k for k in ARCHITECTURES if k[0].isupper())
    raise ModelFileError(
        f"{where}: architecture {cfg.architecture or cfg.model_type!r} is not supported; "
        f"supported are {', '.join(supported)}"
    )
