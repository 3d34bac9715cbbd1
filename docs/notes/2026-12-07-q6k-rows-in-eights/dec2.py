"""Two loads of one GGUF file in one process, measured by bench generate's own `measure` (engines
alternating): A as loaded, B with TMP_NO_Q6X8=<mode> during its load. B's difference needs a
temporary switch in quant/tensor.py for_kernels, not in the tree: one more condition
`or (m.fmt.name == "q6_k" and os.environ.get("TMP_NO_Q6X8") == "1")` (Q6_K kept in GGUF's layout).
Usage: dec2.py FILE REPEATS TOKENS MODE THREADS"""
import os, sys, torch
from hybridmoe.loader import load_model
from hybridmoe.bench.generate import measure, hybridmoe_engine
path, reps, n, mode, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
torch.set_num_threads(threads)
os.environ["TMP_NO_Q6X8"] = "0"; A = load_model(path, dtype=torch.bfloat16, progress=False)
os.environ["TMP_NO_Q6X8"] = mode; B = load_model(path, dtype=torch.bfloat16, progress=False)
os.environ["TMP_NO_Q6X8"] = "0"
prompt = torch.randint(0, 4096, (512,), generator=torch.Generator().manual_seed(0)).tolist()
r = measure({"A": hybridmoe_engine(A), "B": hybridmoe_engine(B)}, prompt, n, reps, 1)
for k, v in r.items():
    print(k, "prefill %.1f decode %.2f" % (v["prefill_tps"], v["decode_tps"]), ["%.1f" % x for x in v["decode_runs"]])
