"""Decode tok/s of a model after a 512-token prompt, RUNS times; with CTL set (a perf control fifo:
perf record --control fifo:CTL -D -1 ...), perf records the decode of every run after the first
and nothing else (no load, no prefill, no exit).
Usage: [CTL=FIFO] PYTHONPATH=. python decode_window.py MODEL THREADS TOKENS RUNS"""
import sys, os, time, torch
from hybridmoe.loader import load_model
from hybridmoe.engine.generate import generate_ids, GenerationStats
from hybridmoe.engine.sampler import SamplingParams
torch.set_num_threads(int(sys.argv[2]))
m = load_model(sys.argv[1], dtype=torch.bfloat16, progress=False)
ids = torch.randint(10, 1000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
p = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0)
ctl = os.environ.get("CTL")
for i in range(int(sys.argv[4])):
    st = GenerationStats()
    first = True
    for _ in generate_ids(m, ids, p, stats=st):
        if first and ctl and i > 0:
            open(ctl, "w").write("enable\n"); first = False
    if ctl and i > 0: open(ctl, "w").write("disable\n")
    print("decode tok/s", round((st.completion_tokens - 1) / st.decode_s, 1))
