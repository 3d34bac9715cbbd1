"""Decode / prefill / batched decode with every block left in the file's map (GGUF rows, page cache):
the RAM-short case. PYTHONPATH=. python mapped.py FILE THREADS"""
import sys, time, torch
from hybridmoe.loader import gguf_file
gguf_file.available_bytes = lambda: 0  # nothing may be copied
from hybridmoe.cli.options import compute_dtype
from hybridmoe.engine.generate import GenerationStats, generate_ids
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model
torch.set_num_threads(int(sys.argv[2]))
model = load_model(sys.argv[1], dtype=compute_dtype("bf16"), progress=False)
prompt = list(range(100, 612))
def run(n):
    s = GenerationStats(); list(generate_ids(model, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), stats=s)); return s
run(4)
r = [run(65) for _ in range(3)]
print("prefill", [round(512 / s.prefill_s) for s in r], "decode", [round(64 / s.decode_s, 1) for s in r])
for B in (4, 16):
    eng = LLMEngine(model, None, EngineConfig(max_batch_size=B, kv_cache_tokens=B * 400 + 512), eos_ids=())
    for b in range(B):
        eng.add_request([100 + b * 7 + i % 50 for i in range(128)], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    steps = []
    while eng.has_unfinished():
        t = time.perf_counter(); eng.step(); steps.append(time.perf_counter() - t)
    dec = sorted(steps[-40:]); med = dec[len(dec)//2]
    print(f"B={B}: {B/med:.0f} tok/s", flush=True)
