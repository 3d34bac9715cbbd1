"""`bench generate --compare-llama-cpp`: hybridmoe and llama.cpp (llama-cpp-python, the `peers`
extra) on the same GGUF file, prompt and greedy decode, each engine in a process of its own
(engine_worker.py) so that each one's resident memory is its own; runs alternate between them
(generate.measure), medians reported, beside the decode roofline of this machine (roofline.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from hybridmoe import env
from hybridmoe.errors import UserError
from hybridmoe.native.build import cpu_flags

ENGINES = ("hybridmoe", "llama.cpp")


class Worker:
    """An engine_worker process: loaded once, then one timing request per call."""

    def __init__(
        self,
        engine: str,
        model: str,
        threads: int,
        dtype: str,
        context: int,
        in_place: bool = False,
    ):
        self.engine, self.log = engine, tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "hybridmoe.bench.engine_worker", engine, model]
        self.proc = subprocess.Popen(
            [*cmd, str(threads), dtype, str(context), "in-place" if in_place else "copied"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env.without_defaults(),
        )
        self.ready = self._reply()
        self.last: dict = {}

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace").strip().splitlines()[-3:]
            code = self.proc.wait(timeout=60)
            said = " / ".join(tail) or (f"killed by signal {-code}" if code < 0 else "no output")
            raise UserError(f"{self.engine} stopped: {said}{_hint(self.engine, code)}")
        return json.loads(line)

    def __call__(self, prompt: list[int], max_tokens: int):
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        self.last = self._reply()
        return self.last["prefill_s"], self.last["decode_s"], self.last["steps"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def _hint(engine: str, code: int) -> str:
    """What to do when llama.cpp dies of SIGILL or SIGSEGV on a CPU with AMX: llama-cpp-python's
    AMX matrix products crash on some (ggml-org/llama.cpp#20824: SIGILL/SIGSEGV at ldtilecfg in
    ggml_backend_amx_mul_mat; seen here on an Intel Xeon VM with llama-cpp-python 0.3.36)."""
    if engine != "llama.cpp" or code not in (-4, -11) or "amx_int8" not in cpu_flags():
        return ""
    return (
        "; llama.cpp's AMX kernels crash on some AMX CPUs: rebuild it without them, "
        'CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" '
        "pip install --no-cache-dir --force-reinstall --no-deps 'llama-cpp-python>=0.3.36,<0.4'"
    )


def check(model: str) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError(
            "--compare-llama-cpp needs llama-cpp-python: pip install -e '.[peers]' "
            "(it compiles llama.cpp, ~15 minutes once)"
        )
    from pathlib import Path

    path = Path(model)
    if not path.is_file() or _magic(path) != b"GGUF":
        raise UserError(
            f"--model {model}: --compare-llama-cpp runs both engines on one GGUF file; "
            "write one with `hybridmoe export` or `hybridmoe bench make-model --format`"
        )


def _magic(path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def compare(args, prompt: list[int]) -> dict:
    """Both engines' medians, memory, first tokens and % of the roofline, as one dict."""
    from hybridmoe.bench.generate import measure
    from hybridmoe.bench.roofline import bytes_per_token, read_bandwidth

    threads = args.threads or os.cpu_count()
    bandwidth = read_bandwidth(threads)  # before the engines hold their memory
    per_token = bytes_per_token(args.model)
    context = len(prompt) + args.max_tokens + 16
    workers = {}
    try:
        for name in ENGINES:  # one at a time: two loads at once would share the cores
            workers[name] = Worker(name, args.model, threads, args.dtype, context, args.in_place)
        result = measure(workers, prompt, args.max_tokens, args.repeats, args.warmup)
        for name, w in workers.items():
            result[name].update(
                load_s=w.ready["load_s"], **{k: w.last[k] for k in ("rss", "peak_rss")}
            )
            result[name]["tokens"] = w.last["tokens"]
    finally:
        for w in workers.values():
            w.close()
    roof = bandwidth / per_token
    for name in ENGINES:
        result[name]["roofline_pct"] = 100 * result[name]["decode_tps"] / roof
    ours, theirs = result["hybridmoe"], result["llama.cpp"]
    same = next(
        (i for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])) if a != b), None
    )
    return {
        **result,
        "threads": threads,
        "read_bandwidth_gbs": bandwidth / 1e9,
        "weight_bytes_per_token": per_token,
        "roofline_tps": roof,
        "same_tokens": len(ours["tokens"]) if same is None else same,
        "prefill_ratio": ours["prefill_tps"] / theirs["prefill_tps"],
        "decode_ratio": ours["decode_tps"] / theirs["decode_tps"],
    }
