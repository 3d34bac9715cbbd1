# Decode tok/s of a model after a 512-token prompt. Usage: python decode.py MODEL THREADS RUNS TOKENS
import sys, time, torch
from hybridmoe.loader import load_model
from hybridmoe.engine.generate import generate_ids, GenerationStats
from hybridmoe.engine.sampler import SamplingParams
torch.set_num_threads(int(sys.argv[2]))
m = load_model(sys.argv[1], dtype=torch.bfloat16, progress=False)
ids = torch.randint(10, 1000, (512,), generator=torch.Generator().manual_seed(0)).tolist()
p = SamplingParams(max_tokens=int(sys.argv[4]), temperature=0)
for i in range(int(sys.argv[3])):
    st = GenerationStats()
    for _ in generate_ids(m, ids, p, stats=st): pass
    print("decode tok/s", round((st.completion_tokens - 1) / st.decode_s, 1))
