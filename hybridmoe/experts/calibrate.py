"""Measure this machine and fit the cost model's constants: the profile `hybridmoe calibrate` writes.

CPU: one SwiGLU expert (the function the runtime runs) over n = 1..512 tokens, for a few expert
shapes; with CUDA, the same on the GPU and pinned host->device copies of several sizes. Some
shapes and token counts fit the constants (experts/cost_model.py `fit`); the others are held out,
and the report gives predicted vs measured time on them, so the profile's error is known.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from hybridmoe.experts.cost_model import CostModel, Sample, fit
from hybridmoe.experts.runtime import expert_ffn
from hybridmoe.experts.store import ExpertWeights

# (hidden, intermediate). 2048x768 is Qwen3-30B-A3B's expert, 4096x1536 a large one (75 MB fp32);
# the held-out shapes lie between them. Fit shapes must be bigger than the last-level cache: a small
# expert (1024x512, 6 MB) runs its batched kernel near cache speed and skews the fit (measured: held-out
# error 46% with it, 19% without).
FIT_SHAPES = ((2048, 768), (4096, 1536))
CHECK_SHAPES = ((1536, 640), (2048, 1024))
FIT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CHECK_TOKENS = (1, 3, 12, 48, 192)
QUICK_FIT_TOKENS = (1, 2, 4, 8, 32, 128)
QUICK_CHECK_TOKENS = (3, 48)
# Decoding streams each expert from RAM once per use; rotating over copies whose total is beyond
# the last-level cache (tens of MB on desktop and server CPUs) keeps the measurement honest.
ROTATE_BYTES = 96e6
DTYPE_QUANT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class Check:
    kind: str
    hidden: int
    intermediate: int
    n_tokens: int
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


@dataclass
class Calibration:
    profile: CostModel
    dtype: torch.dtype
    samples: list[Sample] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def max_cpu_error(self) -> float:
        errs = [abs(c.error) for c in self.checks if c.kind == "cpu"]
        return max(errs) if errs else 0.0

    def to_json(self) -> dict:
        return {
            **self.profile.to_json(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "checks": [{**c.__dict__, "error": round(c.error, 4)} for c in self.checks],
        }

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


# ---- measurements ------------------------------------------------------------------------------


def _experts(hidden: int, inter: int, dtype, device, total_bytes: float) -> list[ExpertWeights]:
    per = 3 * hidden * inter * torch.empty((), dtype=dtype).element_size()
    count = max(2, int(total_bytes // per) + 1)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        gate_up = (torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)  # [2I, H]
        down = (torch.randn(hidden, inter, generator=g) * inter**-0.5).to(dtype)  # [H, I]
        out.append(ExpertWeights(gate_up.to(device), down.to(device)))
    return out


@torch.inference_mode()
def time_cpu_expert(experts: list[ExpertWeights], n: int, reps: int) -> float:
    """Seconds of one expert call on n tokens, each call on a different (cold) copy.

    The minimum over `reps`, not the mean: other load on the machine only ever adds time (and a
    descheduled OpenMP thread stalls a whole call), so the fastest run is the machine's speed.
    With one thread, the process's CPU time is the clock: it equals wall time on an idle machine
    and does not count the time slices other processes take on a busy one.
    """
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    x = torch.randn(n, experts[0].down.shape[0]).to(experts[0].down.dtype)  # [n, H]
    expert_ffn(x, experts[0])  # warm-up: thread pool, kernel selection
    times = []
    for i in range(reps):
        w = experts[(i + 1) % len(experts)]
        t0 = clock()
        expert_ffn(x, w)
        times.append(clock() - t0)
    return min(times)


@torch.inference_mode()
def time_gpu_expert(experts: list[ExpertWeights], n: int, reps: int) -> float:
    """Median seconds of one expert on the GPU (CUDA events), weights already resident."""
    x = torch.randn(n, experts[0].down.shape[0], device="cuda").to(experts[0].down.dtype)
    expert_ffn(x, experts[0])
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        expert_ffn(x, experts[(i + 1) % len(experts)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_copy(nbytes: int, reps: int) -> float:
    """Median seconds of a pinned host->device copy of `nbytes` on a side stream."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


# ---- the calibration run -----------------------------------------------------------------------


def _jobs(quick: bool, cuda: bool) -> list[tuple]:
    """(kind, role, hidden, inter, n) for every measurement, fit ones first."""
    fit_n, check_n = (QUICK_FIT_TOKENS, QUICK_CHECK_TOKENS) if quick else (FIT_TOKENS, CHECK_TOKENS)
    check_shapes = CHECK_SHAPES[:1] if quick else CHECK_SHAPES
    kinds = ("cpu", "gpu") if cuda else ("cpu",)
    jobs = []
    for kind in kinds:
        jobs += [(kind, "fit", h, i, n) for h, i in FIT_SHAPES for n in fit_n]
        jobs += [(kind, "fit", h, i, n) for h, i in FIT_SHAPES[:1] for n in check_n if n not in fit_n]
        jobs += [(kind, "check", h, i, n) for h, i in check_shapes for n in check_n]
    if cuda:  # copies of the fit shapes' sizes and a few more
        jobs += [("copy", "fit", h, i, 0) for h, i in FIT_SHAPES + ((512, 256), (4096, 1536))]
        jobs += [("copy", "check", h, i, 0) for h, i in check_shapes]
    return jobs


def _sample(kind: str, hidden: int, inter: int, n: int, dtype, seconds: float) -> Sample:
    nbytes = 3 * hidden * inter * torch.empty((), dtype=dtype).element_size()
    return Sample(kind, n, seconds, bytes=nbytes, flops=2.0 * 3 * hidden * inter * n)


def _measure_cpu(jobs: list[tuple], dtype, rounds: int, bar) -> list[float]:
    """Seconds per CPU job, the minimum over `rounds` rounds that each visit every job once, so
    that a change of load on the machine affects fitted and held-out points alike."""
    pools = {}
    for _, _, h, i, _ in jobs:
        if (h, i) not in pools:
            pools[(h, i)] = _experts(h, i, dtype, "cpu", ROTATE_BYTES)
    best = [float("inf")] * len(jobs)
    for r in range(rounds):
        for j, (_, _, h, i, n) in enumerate(jobs):
            bar.set_postfix_str(f"cpu {h}x{i} n={n}")
            experts = pools[(h, i)]
            best[j] = min(best[j], time_cpu_expert(experts[r % len(experts) :] + experts[: r % len(experts)], n, 1))
            bar.update()
    return best


def _measure_device(job: tuple, dtype, reps: int) -> float:
    kind, _, h, i, n = job
    if kind == "copy":
        return time_copy(3 * h * i * torch.empty((), dtype=dtype).element_size(), reps)
    return time_gpu_expert(_experts(h, i, dtype, "cuda", 0), n, reps)


def calibrate(dtype: torch.dtype = torch.float32, quick: bool = False, progress: bool = True,
              cuda: bool | None = None) -> Calibration:
    """Measure, fit on the fit set, check on the held-out set."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    rounds = 3 if quick else 7
    jobs = _jobs(quick, cuda)
    cpu_jobs = [j for j in jobs if j[0] == "cpu"]
    device_jobs = [j for j in jobs if j[0] != "cpu"]
    bar = tqdm(total=len(cpu_jobs) * rounds + len(device_jobs), desc="calibrating", unit="run",
               file=sys.stderr, disable=not progress, leave=False)
    seconds = dict(zip(cpu_jobs, _measure_cpu(cpu_jobs, dtype, rounds, bar)))
    for job in device_jobs:
        bar.set_postfix_str(f"{job[0]} {job[2]}x{job[3]} n={job[4]}")
        seconds[job] = _measure_device(job, dtype, rounds)
        bar.update()
    bar.close()
    fit_samples = [_sample(k, h, i, n, dtype, seconds[(k, r, h, i, n)]) for k, r, h, i, n in jobs if r == "fit"]
    profile = fit_profile(fit_samples)
    checks = []
    for job in jobs:
        if job[1] == "check":
            s = _sample(job[0], job[2], job[3], job[4], dtype, seconds[job])
            checks.append(Check(job[0], job[2], job[3], job[4], s.seconds, predict(profile, s)))
    return Calibration(profile, dtype, fit_samples, checks)


def fit_profile(samples: list[Sample]) -> CostModel:
    """The cost model's roofline fit on the batched CPU samples (n >= 2), GPU and copies; then the
    single-token bandwidth (a matrix-vector kernel, faster than GEMM at small n) on the n = 1 ones."""
    ones = [s for s in samples if s.kind == "cpu" and s.n_tokens == 1]
    rest = [s for s in samples if not (s.kind == "cpu" and s.n_tokens == 1)]
    profile = fit(rest if any(s.kind == "cpu" for s in rest) else samples, name="calibrated")
    # t = b / bw + c in relative error: minimise sum(((b u - (t - c)) / t)^2) over u = 1 / bw.
    num = sum(s.bytes * (s.seconds - profile.c_cpu) / s.seconds**2 for s in ones)
    den = sum(s.bytes**2 / s.seconds**2 for s in ones)
    if num > 0:
        profile.bw_cpu_one = den / num
    return profile


def predict(profile: CostModel, s: Sample) -> float:
    """The profile's time for a measured sample (its own bytes and flops), as CostModel computes it."""
    if s.kind == "copy":
        return s.bytes / profile.bw_pcie + profile.c_copy
    if s.kind == "cpu":
        bw = profile.bw_cpu_one if s.n_tokens == 1 and profile.bw_cpu_one else profile.bw_cpu
        return max(s.bytes / bw, s.flops / profile.f_cpu) + profile.c_cpu
    return max(s.bytes / profile.bw_gpu, s.flops / profile.f_gpu) + profile.c_gpu


# ---- where profiles live -----------------------------------------------------------------------


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridmoe"


def default_profile_path(dtype: torch.dtype) -> Path:
    """Per dtype and thread count: both change the CPU's speed."""
    name = str(dtype).removeprefix("torch.")
    return cache_dir() / f"calibration-{name}-{torch.get_num_threads()}threads.json"


def load_or_calibrate(path: str | Path | None, dtype: torch.dtype, progress: bool = True) -> CostModel:
    """The profile at `path`; without one, the cached profile of this machine, measured on first use."""
    if path is not None:
        return CostModel.load(path)
    cached = default_profile_path(dtype)
    if cached.exists():
        try:
            return CostModel.load(cached)
        except Exception:
            pass  # a broken cache file is measured again below
    print(f"hybridmoe: measuring this machine's expert speed once (cached in {cached}); "
          "`hybridmoe calibrate` does a longer run", file=sys.stderr)
    result = calibrate(dtype, quick=True, progress=progress)
    try:
        result.save(cached)
    except OSError as e:
        print(f"hybridmoe: could not cache the calibration in {cached} ({e})", file=sys.stderr)
    return result.profile
