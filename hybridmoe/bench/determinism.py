"""`hybridmoe bench determinism`: what batch invariance (--deterministic on, the default) buys and
costs on the demo model in bf16.

Buys: of 16 greedy prompts, how many answer differently in a batch of 16, repeated with the prefix
cache warm, or prefilled in 7-token chunks, than each alone. Costs: prefill tokens per second of one
long prompt, and decode tokens per second of batches of 1 and 8, on and off alternated in rounds,
medians reported.
"""

from __future__ import annotations

import json
import statistics
import time

TOPICS = ["the sea", "a cat", "Paris", "rain", "music", "the moon", "a train", "coffee"]
TOPICS += ["winter", "a library", "bees", "the desert", "a bridge", "chess", "bread", "a storm"]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "determinism",
        help="batch invariance on the demo model: answers that change with the batch, and speed",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    p.add_argument("--rounds", type=int, default=3, help="speed rounds of on and off")
    p.add_argument("--prompt-tokens", type=int, default=512, help="the long prompt's length")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run)


def differing(model, tok, deterministic: bool, tokens: int) -> dict[str, int]:
    """Prompts (of 16) whose greedy answer in each setting differs from their answer alone."""
    from hybridmoe.engine.config import EngineConfig
    from hybridmoe.engine.llm_engine import LLMEngine
    from hybridmoe.engine.sampler import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    system = "You are a helpful assistant who answers in two short sentences, " * 3
    prompts = [
        tok.encode_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": f"About {t}?"}]
        )
        for t in TOPICS
    ]

    def engine(**config):
        config = EngineConfig(kv_cache_tokens=8192, deterministic=deterministic, **config)
        return LLMEngine(model, tok, config)

    alone = [engine().generate([p], params)[0] for p in prompts]
    warm = engine(max_batch_size=16)
    runs = {
        "batch of 16": warm.generate(prompts, params),
        "prefix cache warm": warm.generate(prompts, params),
        "7-token chunks": engine(max_batch_size=16, max_tokens_per_step=7).generate(
            prompts, params
        ),
    }
    return {name: sum(a != b for a, b in zip(alone, got)) for name, got in runs.items()}


def speeds(model, deterministic: bool, prompt_tokens: int) -> dict[str, float]:
    """Prefill tokens/s of one prompt; decode tokens/s of batches of 1 and 8 (32 steps)."""
    from hybridmoe.engine.config import EngineConfig
    from hybridmoe.engine.llm_engine import LLMEngine
    from hybridmoe.engine.sampler import SamplingParams

    config = EngineConfig(kv_cache_tokens=16384, max_batch_size=8, deterministic=deterministic)
    out = {}
    long = [(7 * i) % 30000 + 100 for i in range(prompt_tokens)]
    engine = LLMEngine(model, None, config)
    t0 = time.perf_counter()
    engine.generate([long], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    out["prefill tok/s"] = prompt_tokens / (time.perf_counter() - t0)
    for batch in (1, 8):
        engine = LLMEngine(model, None, config)
        params = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request([100 + i, 200, 300, 400], params)
        engine.step()  # the prefill and first tokens
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        out[f"decode tok/s, batch {batch}"] = 32 * batch / (time.perf_counter() - t0)
    return out


def run(args) -> int:
    import torch

    from hybridmoe.demo.cache import ensure_demo_model
    from hybridmoe.loader import load_model, load_tokenizer

    torch.set_num_threads(1)  # as serve runs a pass beside another (prefill beside decode)
    path = ensure_demo_model()
    tok = load_tokenizer(path)
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    result = {
        "differing": {
            mode: differing(model, tok, mode == "on", args.tokens) for mode in ("off", "on")
        }
    }
    samples: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            for name, value in speeds(model, mode == "on", args.prompt_tokens).items():
                samples[mode].setdefault(name, []).append(value)
    result["speed"] = {
        mode: {name: statistics.median(v) for name, v in by.items()} for mode, by in samples.items()
    }
    print(json.dumps(result) if args.json else _table(result))
    return 0


def _table(result: dict) -> str:
    lines = ["| --deterministic | " + " | ".join(result["differing"]["on"]) + " |"]
    lines.append("|---" * (1 + len(result["differing"]["on"])) + "|")
    for mode, counts in result["differing"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{n} of 16" for n in counts.values()) + " |")
    names = list(result["speed"]["on"])
    lines += ["", "| --deterministic | " + " | ".join(names) + " |"]
    lines.append("|---" * (1 + len(names)) + "|")
    for mode, values in result["speed"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{values[n]:.1f}" for n in names) + " |")
    return "\n".join(lines)
