import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
def collapse(which):
    done = {}
    for line in open("/proc/self/maps"):
        f = line.split()
        a, b = (int(x, 16) for x in f[0].split("-"))
        path = f[5] if len(f) > 5 else ""
        perm = f[1]
        kind = None
        if "libpython" in path and "x" in perm: kind = "pytext"
        elif ("libtorch_cpu" in path or "libc10" in path or "libtorch_python" in path) and "x" in perm: kind = "torchtext"
        elif (path == "" or path == "[heap]") and perm.startswith("rw") and b - a >= (2 << 20): kind = "anon"
        if kind not in which: continue
        s = (a + (2 << 20) - 1) & ~((2 << 20) - 1); e = b & ~((2 << 20) - 1)
        if e <= s: continue
        libc.madvise(s, e - s, MADV_HUGEPAGE)
        r = libc.madvise(s, e - s, MADV_COLLAPSE)
        done.setdefault(kind, [0, 0])
        done[kind][0 if r == 0 else 1] += (e - s) >> 20
    return done
