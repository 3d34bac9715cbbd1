"""Where a decode token of a GGUF model goes: the native decode loop, the head, the rest."""
import sys, time, torch
from hybridmoe.loader import load_model
from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe import native
from hybridmoe.models import base
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
model = load_model(sys.argv[1], dtype=torch.bfloat16, progress=False)
acc = {"decode_layers": 0.0, "logits": 0.0}
calls = {"decode_layers": 0, "logits": 0}
dl = base.native.decode_layers
def timed_dl(*a, **k):
    t = time.perf_counter(); r = dl(*a, **k); acc["decode_layers"] += time.perf_counter() - t; calls["decode_layers"] += 1; return r
base.native.decode_layers = timed_dl
lg = base.CausalLM.logits
def timed_lg(self, h):
    t = time.perf_counter(); r = lg(self, h); acc["logits"] += time.perf_counter() - t; calls["logits"] += 1; return r
base.CausalLM.logits = timed_lg
prompt = torch.randint(1, 4000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
g = SamplingParams(max_tokens=129, temperature=0, ignore_eos=True)
with torch.inference_mode():
    list(generate_ids(model, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    for k in acc: acc[k] = 0.0; calls[k] = 0
    t0 = time.perf_counter(); it = generate_ids(model, prompt, g); next(it); t1 = time.perf_counter()
    for k in acc: acc[k] = 0.0; calls[k] = 0
    n = sum(1 for _ in it); t2 = time.perf_counter()
per = (t2 - t1) / n * 1e3
print(f"prefill {t1-t0:.3f} s; decode {n} tokens {per:.3f} ms/token; decode_layers {acc['decode_layers']/n*1e3:.3f} ms ({calls['decode_layers']/n:.1f}/tok); logits {acc['logits']/n*1e3:.3f} ms; rest {per - (acc['decode_layers']+acc['logits'])/n*1e3:.3f} ms")
