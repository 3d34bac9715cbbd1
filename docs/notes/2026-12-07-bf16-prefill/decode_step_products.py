"""A demo decode step's bf16 products (30 layers of distinct weights, from RAM), the row kernel against
the tiles, medians of 5 alternating. `python decode_step_products.py M` at fa32040."""
# A decode step's bf16 products of the demo model, from RAM (30 layers of distinct weights), M rows, 1 thread.
import torch, time, sys
from hybridmoe.native import bf16 as nb
torch.set_num_threads(1)
lib = nb.library()
M = int(sys.argv[1]) if len(sys.argv) > 1 else 1
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (16, 576)] + [(96, 576), (576, 48)] * 8 + [(1536, 576), (576, 768)]
layers = [[(torch.randn(O, I) * 0.05).bfloat16() for O, I in shapes] for _ in range(30)]
xs = {I: torch.randn(M, I).bfloat16() for I in (576, 48, 768)}
ys = {O: torch.empty(M, O) for O in (576, 192, 16, 96, 1536)}
def step():
    for ws in layers:
        for w in ws:
            O, I = w.shape
            lib.hm_gemm_bf16(w.data_ptr(), xs[I].data_ptr(), I, ys[O].data_ptr(), O, O, I, M)
res = {}
for on in (False, True) * 5:
    nb.use_amx(on)
    step()
    t0 = time.perf_counter()
    for _ in range(3): step()
    res.setdefault(on, []).append((time.perf_counter() - t0) / 3 * 1e3)
import statistics
print('M', M, 'avx %.2f ms  amx %.2f ms (median of 5)' % (statistics.median(res[False]), statistics.median(res[True])))
