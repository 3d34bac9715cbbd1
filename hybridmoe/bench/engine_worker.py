"""One engine in a process of its own, for `bench generate --compare-llama-cpp`: it loads a model
(hybridmoe's engine or llama.cpp's, through llama-cpp-python), then answers timing requests on
stdin with JSON lines on stdout, each with its own resident memory, so that neither engine's
memory counts against the other's.

    python -m hybridmoe.bench.engine_worker ENGINE MODEL THREADS DTYPE CONTEXT copied|in-place
    stdin:  {"prompt": [ids], "max_tokens": N}
    stdout: {"prefill_s": s, "decode_s": s, "steps": n, "tokens": [ids], "rss": B, "peak_rss": B}
"""

from __future__ import annotations

import json
import sys
import time


def memory() -> dict:
    """Resident and peak resident bytes of this process (Linux /proc), and what is resident now
    split into anonymous memory (the process's own) and file-backed pages (mapped files: a GGUF
    model's weights, the page cache the kernel may drop and read again)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return {
        "rss": fields.get("VmRSS", 0),
        "peak_rss": fields.get("VmHWM", 0),
        "rss_anon": fields.get("RssAnon", 0),
        "rss_file": fields.get("RssFile", 0),
    }


def hybridmoe_runner(model_path: str, threads: int, dtype: str, context: int, in_place: bool):
    import torch

    from hybridmoe.cli.options import compute_dtype
    from hybridmoe.engine.generate import GenerationStats, generate_ids
    from hybridmoe.engine.sampler import SamplingParams
    from hybridmoe.loader import load_model

    torch.set_num_threads(threads)
    model = load_model(
        model_path, dtype=compute_dtype(dtype), progress=False, copy_blocks=not in_place
    )

    def run(prompt, max_tokens):  # bench generate's loop (hybridmoe_engine), keeping the tokens
        stats = GenerationStats()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        tokens = list(generate_ids(model, prompt, params, stats=stats))
        return stats.prefill_s, stats.decode_s, max(stats.completion_tokens - 1, 0), tokens

    return run


def llama_cpp_runner(model_path: str, threads: int, dtype: str, context: int, in_place: bool):
    """llama.cpp through llama-cpp-python: the prompt in batches of 512 (its default), then one
    token per call, greedy from the last logits (no sampler chain, as ours). It reads its file in
    place whatever `in_place` says (its mmap)."""
    import numpy as np

    from hybridmoe import env

    env.drop_defaults()  # before llama.cpp's OpenMP loads: it runs as its users run it
    from llama_cpp import Llama

    llm = Llama(
        model_path=model_path,
        n_ctx=context,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    vocab = llm.n_vocab()

    def top():
        return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())

    def run(prompt, max_tokens):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        tokens = [top()]
        t1 = time.perf_counter()
        for _ in range(max_tokens - 1):
            llm.eval(tokens[-1:])
            tokens.append(top())
        return t1 - t0, time.perf_counter() - t1, max_tokens - 1, tokens

    return run


RUNNERS = {"hybridmoe": hybridmoe_runner, "llama.cpp": llama_cpp_runner}


def main(argv: list[str]) -> int:
    engine, model_path, threads, dtype, context, blocks = argv
    t0 = time.perf_counter()
    run = RUNNERS[engine](model_path, int(threads), dtype, int(context), blocks == "in-place")
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0, **memory()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        prefill_s, decode_s, steps, tokens = run(request["prompt"], request["max_tokens"])
        reply = {"prefill_s": prefill_s, "decode_s": decode_s, "steps": steps, "tokens": tokens}
        print(json.dumps({**reply, **memory()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
