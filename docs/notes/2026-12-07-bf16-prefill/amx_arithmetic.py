"""Which arithmetic gives tdpbf16ps's sums: the tiles' products (amx_arithmetic.c amx_gemm) against
vdpbf16ps lane 0 and fp32/fp64 emulations, one output at a time. None matched all 256 outputs (best:
the 32 products of a tile row summed exactly, rounded, then added: 170 of 256)."""
import ctypes, os, subprocess, torch
here = os.path.dirname(os.path.abspath(__file__))
subprocess.run(['gcc', '-O2', '-march=native', '-ffp-contract=off', '-shared', '-fPIC', os.path.join(here, 'amx_arithmetic.c'), '-o', '/tmp/amx_arithmetic.so'], check=True)
lib = ctypes.CDLL('/tmp/amx_arithmetic.so'); lib.permit()
P, L = ctypes.c_void_p, ctypes.c_long
lib.amx_gemm.argtypes = [P, P, L, P, L, L, L, L]
lib.emu.argtypes = [P, P, L, ctypes.c_int]; lib.emu.restype = ctypes.c_float
torch.manual_seed(1)
O, I = 64, 576
w = (torch.randn(O, I) * 0.05).bfloat16(); x = torch.randn(4, I).bfloat16()
y = torch.empty(4, O)
lib.amx_gemm(w.data_ptr(), x.data_ptr(), I, y.data_ptr(), O, O, I, 4)
for mode in range(5):
    same = sum(lib.emu(w[o].data_ptr(), x[m].data_ptr(), I, mode) == y[m, o].item() for o in range(O) for m in range(4))
    print(mode, same, 'of', O * 4)
lib.emu2.argtypes = [P, P, L, ctypes.c_int, ctypes.c_int]; lib.emu2.restype = ctypes.c_float
for n in (1, 2, 4, 8, 16):
    for mode in (0, 1):
        same = sum(lib.emu2(w[o].data_ptr(), x[m].data_ptr(), I, n, mode) == y[m, o].item() for o in range(O) for m in range(4))
        print('group', n, 'mode', mode, same, 'of', O * 4)
