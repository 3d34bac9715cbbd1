"""A 512-token prefill of the demo model (exported GGUF bf16 at /tmp/m/demo-bf16.gguf) under
cProfile: `OMP_WAIT_POLICY=PASSIVE python prefill_profile.py THREADS` (the CLI sets PASSIVE; without
it OpenMP's threads spin beside the pool's and the figures mislead)."""
import sys, time, torch, cProfile, pstats
from hybridmoe.loader import load_model
from hybridmoe.engine.generate import GenerationStats, generate_ids
from hybridmoe.engine.sampler import SamplingParams
t = int(sys.argv[1]); torch.set_num_threads(t)
model = load_model('/tmp/m/demo-bf16.gguf', dtype=torch.bfloat16, progress=False)
prompt = torch.randint(0, 49152, (512,), generator=torch.Generator().manual_seed(0)).tolist()
def run():
    stats = GenerationStats()
    for _ in generate_ids(model, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), stats=stats): pass
    return stats.prefill_s
for _ in range(2): run()
pr = cProfile.Profile(); pr.enable(); s = run(); pr.disable()
print('prefill', s)
pstats.Stats(pr).sort_stats('tottime').print_stats(25)
