"""Named hardware profiles for simulation: cost-model constants of machines we do not have.

Sources: "DESIGN" = the measured figures of docs/architecture.md ("Figures behind the defaults");
"spec" = the vendor's public specification; "pub." = a measurement published with the figure it
is checked against (docs/benchmarks.md, "Simulator against published machines"); "est." = our
estimate, with the reasoning beside it. A calibrated profile of a real machine (`hybridmoe
calibrate`) always beats these.

Rules every profile follows, so that no machine is tuned to its own published figure:

- DRAM: `bw_dram` is what all cores read together (measured where published, else DRAM_SHARE of
  the spec); the expert kernel streams at CPU_STREAM_SHARE of it (`bw_cpu`).
- GGUF block formats: the CPU's Q4_K / Q8_0 matrix-vector kernels (llama.cpp, llamafile) are
  bound by dequantisation before bandwidth on many cores: Q4K_BYTES_PER_CORE per core.
- Fixed costs: a CPU expert call 5 us (waking the pool, est.); a GPU expert call 5 us and a copy
  10 us (one kernel launch / cudaMemcpyAsync each, est.); a small GPU kernel of the dense part
  C_KERNEL; one CPU<->GPU synchronisation a layer C_SYNC.
"""

from __future__ import annotations

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cost_model import QUANT_BYTES, CostModel

GB = 1e9
T = 1e12
US = 1e-6

# DESIGN: a dual-channel DDR5-6000 desktop reads 60-63 GB/s with all cores of its 96 spec.
DRAM_SHARE = 63 / 96
CPU_STREAM_SHARE = 60 / 63
# est., chosen on one published row and checked on the others (docs/benchmarks.md, "Simulator
# against published machines"): KTransformers' DeepSeek-V3 Q4_K_M decode on a 32-core Xeon Gold
# 6454S (8.73 tok/s) implies ~3.5 GB/s of Q4_K weights per core, well under its DRAM.
Q4K_BYTES_PER_CORE = 3.5 * GB
C_KERNEL = 2.5 * US  # est.: a small kernel in a CUDA graph, launch and run, on Turing to Hopper
C_SYNC = 15 * US  # est.: the GPU waits on an event for the CPU's result, the CPU pool's barrier


def _block_formats(bw_cpu: float, cores: int) -> dict[str, float]:
    """Effective CPU bytes/s of the GGUF block formats: dequantisation-bound per core."""
    q4 = min(bw_cpu, cores * Q4K_BYTES_PER_CORE)
    q8 = min(bw_cpu, cores * Q4K_BYTES_PER_CORE * QUANT_BYTES["q8_0"] / QUANT_BYTES["q4_k"])
    # (est.) the other 4-6 bit formats decode as Q4_K does
    return {"q4_k": q4, "q5_k": q4, "q6_k": q4, "q4_0": q4, "q4_1": q4, "q8_0": q8}


def _machine(name, dram, cores, f_cpu, bw_gpu=0.0, f_gpu=0.0, bw_pcie=0.0, **extra) -> CostModel:
    bw_cpu = CPU_STREAM_SHARE * dram
    gpu = {}
    if bw_gpu:
        gpu = dict(
            bw_gpu=bw_gpu, f_gpu=f_gpu, c_gpu=5 * US, bw_pcie=bw_pcie, c_copy=10 * US,
            c_act=10 * US, c_kernel=C_KERNEL, c_sync=C_SYNC,
        )  # fmt: skip
    return CostModel(
        name=name,
        bw_cpu=bw_cpu,
        f_cpu=f_cpu,
        c_cpu=5 * US,
        bw_dram=dram,
        bw_cpu_by_quant=_block_formats(bw_cpu, cores),
        **gpu,
        **extra,
    )


PROFILES: dict[str, CostModel] = {
    # 16-core desktop, dual-channel DDR5 (DESIGN: 63 GB/s read), RTX 4090: 920 GB/s measured
    # (DESIGN), 165 TFLOP/s bf16 (DESIGN), PCIe 4.0 x16 pinned 24 GB/s (DESIGN).
    # f_cpu est.: 16 cores x AVX-512/AVX2 FMA ~4 TFLOP/s fp32 peak, expert kernels reach ~25%.
    "rtx4090-ddr5": _machine("rtx4090-ddr5", 63 * GB, 16, 1.0 * T, 920 * GB, 165 * T, 24 * GB),
    # 8-16 core desktop, dual-channel DDR4-3200: 51.2 GB/s spec; RTX 3090: 936 GB/s, 71 TFLOP/s
    # dense bf16 (spec); PCIe 4.0 x16 (DESIGN). f_cpu est. as above for 12 cores.
    "rtx3090-ddr4": _machine(
        "rtx3090-ddr4", DRAM_SHARE * 51.2 * GB, 12, 0.8 * T, 936 * GB, 71 * T, 24 * GB
    ),
    # Desktop as rtx4090-ddr5 with an RTX 4060: 272 GB/s (spec), ~30 TFLOP/s fp16 tensor with fp32
    # accumulate (spec: ~60 with fp16 accumulate), PCIe 4.0 x8: half of DESIGN's x16.
    "rtx4060-8gb-ddr5": _machine(
        "rtx4060-8gb-ddr5", 63 * GB, 16, 1.0 * T, 272 * GB, 30 * T, 12 * GB
    ),
    # Desktop as rtx4090-ddr5 with 8 cores and an RTX 4070: 504 GB/s, ~29 TFLOP/s (spec), PCIe 4.0
    # x16 (DESIGN). The machine of the published --cpu-moe figure names no CPU: est. an 8-core.
    "rtx4070-ddr5": _machine("rtx4070-ddr5", 63 * GB, 8, 0.5 * T, 504 * GB, 29 * T, 24 * GB),
    # Core i9-10900X (10 cores, AVX-512), quad-channel DDR4: ~102 GB/s measured (pub.); RTX 2080:
    # 448 GB/s, ~20 TFLOP/s fp16 tensor with fp32 accumulate (spec), PCIe 3.0 x16: half of 4.0.
    # f_cpu est.: 10 cores x 2 AVX-512 FMA x 16 x 2 x 3.7 GHz = 2.4 TFLOP/s peak, ~25%.
    "rtx2080-i9-10900x": _machine(
        "rtx2080-i9-10900x", 102 * GB, 10, 0.6 * T, 448 * GB, 20 * T, 12 * GB
    ),
    # One Xeon Gold 6454S (32 cores, AVX-512, AMX), 8 x DDR5-4800: 307 GB/s spec; RTX 4090D:
    # 1008 GB/s (spec), ~147 TFLOP/s bf16 (spec), PCIe 5.0 host, the card at 4.0 x16 (DESIGN).
    # f_cpu est.: 32 x 2 x 16 x 2 x 2.2 GHz = 4.5 TFLOP/s fp32 peak, ~25%.
    "xeon6454s-4090d": _machine(
        "xeon6454s-4090d", DRAM_SHARE * 307 * GB, 32, 1.1 * T, 1008 * GB, 147 * T, 24 * GB
    ),
    # Sapphire Rapids, 56 cores, 8 x DDR5-4800 = 307 GB/s per socket (spec); H100 SXM5: 3.35 TB/s
    # HBM3, 989 TFLOP/s dense bf16 (spec); PCIe 5.0 x16 (DESIGN). f_cpu est.: AMX bf16, well
    # below its ~200 TFLOP/s peak for skinny matmuls.
    "h100-spr": _machine(
        "h100-spr", DRAM_SHARE * 307 * GB, 56, 20 * T, 3350 * GB, 989 * T, 56 * GB
    ),
    # The development machine: 2 cores, AVX-512 VNNI, no GPU. Effective bandwidth per format is
    # DESIGN's per-expert timing of a 4.72 M-param Qwen3-30B-A3B expert at batch 1, 2 threads:
    # fp32 958 us (18.9 MB), bf16 767 us (9.4 MB), int8 466 us (4.7 MB), int4 241 us (2.4 MB).
    "this-machine-2core": CostModel(
        name="this-machine-2core",
        bw_cpu=23.5 * GB,  # DESIGN: 23-24 GB/s read with 2 threads (pure streaming)
        f_cpu=0.15 * T,  # est.: 2 cores x 2 FMA x 16 lanes x 2 x ~2.5 GHz = 320 GFLOP/s peak, ~50%
        c_cpu=5 * US,
        bw_cpu_by_quant={
            "f32": 18.9e6 / 958e-6,
            "bf16": 9.44e6 / 767e-6,
            "int8": 4.72e6 / 466e-6,
            "q8_0": 4.72e6 / 466e-6,
            "int4": 2.36e6 / 241e-6,
            "q4_k": 2.36e6 / 241e-6,
        },
    ),
}


# (VRAM, RAM) in GB of each profiled machine, for `hybridmoe plan`. VRAM: vendor spec. RAM: est.,
# a typical build of that class (desktop 64 GB, budget desktop 32 GB, server 512 GB), or pub.
MEMORY_GB: dict[str, tuple[float, float]] = {
    "rtx4090-ddr5": (24, 64),
    "rtx3090-ddr4": (24, 64),
    "rtx4060-8gb-ddr5": (8, 32),
    "rtx4070-ddr5": (12, 32),  # pub.: 31 GB of system RAM
    "rtx2080-i9-10900x": (8, 64),  # pub.: 62.5 GB
    "xeon6454s-4090d": (24, 512),  # pub.: 382 GB used by a single socket's run
    "h100-spr": (80, 512),
    "this-machine-2core": (0, 23),  # no GPU; 23 GB total RAM (`free -g`)
}


def get_profile(name: str) -> CostModel:
    """A named profile, or the path of a JSON profile written by `hybridmoe calibrate`."""
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json"):
        return CostModel.load(name)
    raise UserError(
        f"unknown hardware profile {name!r}; use one of {', '.join(PROFILES)} or a calibration "
        "JSON file"
    )
