"""The demo model's held-out perplexity and top-1 agreement per weight format, through our engine
(tests/held_out.py's corpus and loop; fp32 activations, 1 thread). From the repository root:
    python docs/notes/2026-12-07-q8-0-tiles/demo_formats.py"""
import math
import sys
import time

import torch

sys.path.insert(0, ".")
from tests.contiguous_kv import BatchKVContext, SequenceKV  # noqa: E402

from hybridmoe.demo.shipped import load_corpus  # noqa: E402
from hybridmoe.loader import load_model  # noqa: E402

CACHE = "/root/.cache/hybridmoe/demo-smollm2-e16k8s768-v5"
RUNS = [
    ("directory (safetensors, fp32)", CACHE, None),
    ("directory, --quant q8_0", CACHE, "q8_0"),
    ("directory, --quant q6_k", CACHE, "q6_k"),
    ("directory, --quant q4_k", CACHE, "q4_k"),
    ("directory, --quant q4_0", CACHE, "q4_0"),
    ("GGUF bf16 (export)", CACHE + "-bf16.gguf", None),
    ("GGUF q8_0 (export)", CACHE + "-q8_0.gguf", None),
    ("GGUF q4_k_m (export)", CACHE + "-q4_k_m.gguf", None),
]


def stats(path, quant, sequences=32):
    model, text = load_model(path, progress=False, quant=quant), load_corpus("evaluation")
    nll, count, tops = 0.0, 0, []
    with torch.inference_mode():
        for row, m, sc in list(zip(text.ids, text.mask, text.scored))[:sequences]:
            toks = row[m]
            hidden = model(toks, torch.arange(len(toks)), BatchKVContext([SequenceKV()], [len(toks)]))
            logits, scored = model.logits(hidden)[:-1], sc[m][1:]
            nll -= torch.log_softmax(logits, -1).gather(-1, toks[1:, None])[:, 0][scored].sum().item()
            count += int(scored.sum())
            tops.append(logits.argmax(-1)[scored])
    return math.exp(nll / count), torch.cat(tops), count


torch.set_num_threads(1)
base = None
for name, path, quant in RUNS:
    t = time.perf_counter()
    ppl, tops, n = stats(path, quant)
    base = tops if base is None else base
    agree = (tops == base).float().mean().item()
    print(f"| {name} | {ppl:.3f} | {100 * agree:.1f}% | {n} | {time.perf_counter() - t:.0f} s |", flush=True)
