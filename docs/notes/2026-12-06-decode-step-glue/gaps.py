"""Gaps between native calls at decode, by (previous call, next call), without a profiler.
Usage: PYTHONPATH=. python gaps.py MODEL.gguf THREADS  (env PL: prompt length, default 512;
COLLAPSE=anon: MADV_COLLAPSE the anonymous memory first, collapse.py)."""
import sys, time, torch, functools, collections
from hybridmoe.native import bf16 as B, quant as Q
import hybridmoe.native as N
ev = []
def wrap(mod, name):
    f = getattr(mod, name); key = mod.__name__.split(".")[-1] + "." + name
    def g(*a, **k):
        t = time.perf_counter_ns(); r = f(*a, **k); ev.append((key, t, time.perf_counter_ns())); return r
    setattr(mod, name, g)
for name in ["moe_tokens", "linear", "linears"]: wrap(Q, name)
for name in ["decoder_attention", "linear", "shared_moe_token", "decode_attention"]:
    getattr(N, name); wrap(B, name); setattr(N, name, getattr(B, name))
from hybridmoe.cli.options import compute_dtype
from hybridmoe.engine.generate import GenerationStats, generate_ids
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.loader import load_model
path, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
model = load_model(path, dtype=compute_dtype("bf16"), progress=False)
import os; prompt = list(range(5, 5 + int(os.environ.get("PL", "512"))))
def run(n):
    st = GenerationStats()
    list(generate_ids(model, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), stats=st))
    return st
run(8)
if os.environ.get("COLLAPSE"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from collapse import collapse; print(collapse(set(os.environ["COLLAPSE"].split(","))))
for r in range(3):
    ev.clear(); st = run(65)
    # decode events: skip until prefill done: take last 64*per_step events
    gaps = collections.defaultdict(list); kern = collections.defaultdict(list)
    evs = ev[len(ev)//4:]  # well inside decode
    for (a, ta, ea), (b, tb, eb) in zip(evs, evs[1:]):
        gaps[(a, b)].append((tb - ea) / 1e3)
    for k, t, e in evs: kern[k].append((e - t) / 1e3)
    steps = sum(1 for k, *_ in evs if k == "bf16.decoder_attention") / len(model.layers)
    print(f"decode {1000*st.decode_s/64:.2f} ms/tok, {steps} steps in window")
    for k, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1])):
        v.sort(); print(f"  gap {k[0]:>22} -> {k[1]:<22} n/step {len(v)/steps:4.1f} median {v[len(v)//2]:7.1f} us  per step {sum(v)/steps:7.1f} us")
    for k, v in kern.items():
        v.sort(); print(f"  kernel {k:<22} n/step {len(v)/steps:4.1f} median {v[len(v)//2]:7.1f} us per step {sum(v)/steps:7.1f}")
