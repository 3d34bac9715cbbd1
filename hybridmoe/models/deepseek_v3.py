"""DeepSeek-V3 (and R1, Kimi-K2 shapes): DeepSeek-V2's model with a sigmoid router — scores plus
e_score_correction_bias choose the groups (top-2 sum) and experts, the plain scores weigh them — and
rope_interleave as a setting."""

from __future__ import annotations

from hybridmoe.models.deepseek_v2 import DeepseekV2ForCausalLM


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    scoring = "sigmoid"

    @staticmethod
    def rope_interleaved(cfg) -> bool:
        return bool(cfg.get("rope_interleave", default=True))
