"""One-row bf16 products from RAM, one thread: each build with the non-temporal prefetch
(WEIGHTS_NTA=1) and with the L1/L2 one (0). Run from this folder or with it on PYTHONPATH."""
import torch
from krows import rates

from hybridmoe.native import bf16 as k
from hybridmoe.native.build import load


def flags(isa, nta):
    return [f for f in k.flags(isa) if not f.startswith("-DWEIGHTS_NTA")] + [f"-DWEIGHTS_NTA={nta}"]


torch.set_num_threads(1)
libs = {f"{n} nta={nta}": load(k.SOURCE, flags(i, nta), k.SIGNATURES, k.HEADERS)
        for n, i in (("native", k.NATIVE), ("emulated", k.EMULATED)) for nta in (1, 0)}
rates(libs, [(4096, 576, "RAM"), (4096, 768, "RAM"), (4096, 2048, "RAM"), (49152, 576, "RAM")], reps=100)
