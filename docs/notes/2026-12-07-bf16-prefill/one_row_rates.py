"""The timing loop of stream_layouts.py and stream_tiled.py: GB/s of one-row products, the row kernel
(hm_gemm_bf16 over `ws`) against each library's amx1 (over `wt`, the same weights in its layout),
`rounds` rounds alternating; `after(y)` sees each library's output of a round."""
import time


def one_row_rates(nat, libs, ws, wt, x, y, rounds, after=lambda y: None):
    O, I = ws[0].shape
    gb = len(ws) * 2 * O * I / 1e9
    res = {}
    for _ in range(rounds):
        t0 = time.perf_counter()
        for w in ws:
            nat.hm_gemm_bf16(w.data_ptr(), x.data_ptr(), I, y.data_ptr(), O, O, I, 1)
        res.setdefault("row kernel", []).append(gb / (time.perf_counter() - t0))
        for k, lib in libs.items():
            t0 = time.perf_counter()
            for w in wt:
                lib.amx1(w.data_ptr(), x.data_ptr(), y.data_ptr(), O, I)
            res.setdefault(k, []).append(gb / (time.perf_counter() - t0))
            after(y)
    return res
