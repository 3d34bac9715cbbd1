"""Decode steps of B sequences together through the engine (LLMEngine, greedy, 128-token prompts, 80
tokens each), the median of the last 60 steps: PYTHONPATH=. python batched_decode.py FILE.gguf THREADS 1,2,4,8"""
import sys, time, torch
from hybridmoe.cli.options import compute_dtype
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model
torch.set_num_threads(int(sys.argv[2]))
model = load_model(sys.argv[1], dtype=compute_dtype("bf16"), progress=False)
for B in [int(b) for b in sys.argv[3].split(",")]:
    eng = LLMEngine(model, None, EngineConfig(max_batch_size=B, kv_cache_tokens=B * 400 + 512), eos_ids=())
    for b in range(B):
        eng.add_request([100 + b * 7 + i % 50 for i in range(128)], SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    steps = []
    while eng.has_unfinished() if hasattr(eng, "has_unfinished") else eng.scheduler.running or eng.scheduler.waiting:
        t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
    dec = sorted(steps[-60:])
    med = dec[len(dec)//2]
    print(f"B={B:2d}: decode step {med*1e3:.2f} ms, {B/med:.0f} tok/s", flush=True)
