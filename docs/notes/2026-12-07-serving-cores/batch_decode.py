"""Decode steps of B sequences (default 8) on the built-in demo model, deterministic, at THREADS torch
threads (default 1): the native loop's call per step and its experts' share (medians).
Usage: OMP_WAIT_POLICY=PASSIVE PYTHONPATH=TREE python batch_decode.py THREADS B"""
import sys, time, torch
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.models.base import CausalLM
from hybridmoe.loader import load_model
from hybridmoe.demo.cache import ensure_demo_model as demo_model_path
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
model = load_model(demo_model_path(), dtype=torch.bfloat16, progress=False)
looped = []
orig = CausalLM._decode_layers
def layers(self, x, cos_sin, ctx, start=0):
    t0 = time.perf_counter(); done, out = orig(self, x, cos_sin, ctx, start)
    looped.append((x.shape[0], done, time.perf_counter() - t0)); return done, out
CausalLM._decode_layers = layers
import hybridmoe.native as N, hybridmoe.models.base as MB
secs_all = []
odl = N.decode_layers
def dl(*a, **k):
    r = odl(*a, **k); secs_all.append((a[1].shape[0], float(r[5].sum()))); return r
N.decode_layers = dl
gen = torch.Generator().manual_seed(0)
B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
prompts = [torch.randint(5, 49000, (128,), generator=gen).tolist() for _ in range(B)]
with torch.inference_mode():
    for r in range(3):
        eng = LLMEngine(model, None, EngineConfig(), eos_ids=())
        looped.clear()
        t0 = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), max_steps=10000)
        t = time.perf_counter() - t0
        full = sorted(s for n, d, s in looped if n == B)
        ex = sorted(v for n, v in secs_all if n == B); secs_all.clear()
        print(f"experts median {1000*ex[len(ex)//2]:.2f} ms")
        print(f"B={B} total {t:.2f}s, loop calls with {B} rows: {len(full)}, median {1000*full[len(full)//2]:.2f} ms")
