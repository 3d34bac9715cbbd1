"""Prefill tok/s of a 512-token prompt through the engine, deterministic on vs off, alternating."""
import sys, time, statistics, torch
from hybridmoe.loader import load_model, model_config
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sampler import SamplingParams
torch.set_num_threads(int(sys.argv[2]))
path = sys.argv[1]
model = load_model(path, dtype=torch.bfloat16, progress=False)
vocab = model_config(path).get("vocab_size")
prompt = torch.randint(0, vocab, (512,), generator=torch.Generator().manual_seed(0)).tolist()
params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
res = {True: [], False: []}
for i in range(4):
    for det in (True, False):
        eng = LLMEngine(model, None, EngineConfig(kv_cache_tokens=2048, deterministic=det, max_tokens_per_step=512))
        t = time.perf_counter(); eng.generate([prompt], params); dt = time.perf_counter() - t
        if i: res[det].append(512 / dt)
for det in (True, False):
    print(f"deterministic {'on ' if det else 'off'}: prefill {statistics.median(res[det]):.1f} tok/s  runs {[round(v,1) for v in res[det]]}")
