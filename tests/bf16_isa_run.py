"""`python -m tests.bf16_isa_run MODEL_DIR` in a process of its own, HYBRIDMOE_BF16_ISA set by the
caller (tests/test_bf16_isa.py): a bf16 model's batch of prompts through the engine, batch
invariance on and off, and one JSON line: the kernels' build, the tokens and a digest of the bits
of every logits row the model computed."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model
from hybridmoe.models.base import CausalLM
from hybridmoe.native import bf16


def main(path: str) -> None:
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    digest, rows = hashlib.sha256(), [0]
    logits = CausalLM.logits

    def spy(self, hidden):
        out = logits(self, hidden)
        digest.update(out.float().contiguous().view(torch.int32).numpy().tobytes())
        rows[0] += out.reshape(-1, out.shape[-1]).shape[0]
        return out

    CausalLM.logits = spy
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 96, (n,), generator=gen).tolist() for n in (1, 5, 17, 33, 9, 70)]
    tokens = []
    with torch.inference_mode():
        for deterministic in (True, False):
            config = EngineConfig(
                block_size=4, max_batch_size=4, max_tokens_per_step=80, deterministic=deterministic
            )
            eng = LLMEngine(model, None, config, eos_ids=())
            greedy = SamplingParams(max_tokens=10, temperature=0)
            tokens.append(eng.generate(prompts, greedy, max_steps=500))
    record = {"isa": bf16.isa(), "available": bf16.available(), "amx": bf16.amx_active()}
    record |= {"tokens": tokens, "rows": rows[0], "digest": digest.hexdigest()}
    print(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
