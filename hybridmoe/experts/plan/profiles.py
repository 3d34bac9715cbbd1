"""Named hardware profiles for simulation: cost-model constants of machines we do not have.

Sources: "DESIGN" = the measured figures of docs/architecture.md ("Figures behind the defaults");
"spec" = the vendor's public specification; "est." = our estimate, with the reasoning beside it.
Fixed costs (c_*) are typical launch/dispatch latencies (est.: a CUDA kernel launch or a
cudaMemcpyAsync call is ~5-10 us; waking a CPU thread pool ~5 us). A calibrated profile of a real
machine (`hybridmoe calibrate`) always beats these.
"""

from __future__ import annotations

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cost_model import CostModel

GB = 1e9
T = 1e12
US = 1e-6

PROFILES: dict[str, CostModel] = {
    "rtx4090-ddr5": CostModel(
        name="rtx4090-ddr5",
        bw_cpu=60 * GB,  # DESIGN: dual-channel DDR5 desktop, all cores, 60-63 GB/s measured
        f_cpu=1.0
        * T,  # est.: 16 cores x AVX-512/AVX2 FMA ~4 TFLOP/s fp32 peak, expert kernels reach ~25%
        c_cpu=5 * US,
        bw_gpu=920 * GB,  # DESIGN: RTX 4090, 920 GB/s measured
        f_gpu=165 * T,  # DESIGN: 165 TFLOP/s bf16
        c_gpu=5 * US,
        bw_pcie=24 * GB,  # DESIGN: PCIe 4.0 x16 host->device, pinned
        c_copy=10 * US,
        c_act=10 * US,
    ),
    "rtx3090-ddr4": CostModel(
        name="rtx3090-ddr4",
        bw_cpu=40
        * GB,  # est.: dual-channel DDR4-3200 is 51.2 GB/s (spec); ~78% reached, as DDR5 above
        f_cpu=0.8 * T,  # est.: 8-16 AVX2 cores, ~25% of peak
        c_cpu=5 * US,
        bw_gpu=936 * GB,  # spec: RTX 3090, 936 GB/s GDDR6X
        f_gpu=71 * T,  # spec: 71 TFLOP/s dense bf16 tensor
        c_gpu=5 * US,
        bw_pcie=24 * GB,  # DESIGN: PCIe 4.0 x16 pinned
        c_copy=10 * US,
        c_act=10 * US,
    ),
    "rtx4060-8gb-ddr5": CostModel(
        name="rtx4060-8gb-ddr5",
        bw_cpu=60 * GB,  # DESIGN: dual-channel DDR5 desktop
        f_cpu=1.0 * T,  # est., as rtx4090-ddr5
        c_cpu=5 * US,
        bw_gpu=272 * GB,  # spec: RTX 4060, 272 GB/s GDDR6
        f_gpu=30
        * T,  # spec: ~60 TFLOP/s fp16 tensor with fp16 accumulate; half with fp32 accumulate
        c_gpu=5 * US,
        bw_pcie=12 * GB,  # est.: the 4060 is PCIe 4.0 x8, half of DESIGN's 24 GB/s for x16
        c_copy=10 * US,
        c_act=10 * US,
    ),
    "h100-spr": CostModel(
        name="h100-spr",
        bw_cpu=220
        * GB,  # est.: Sapphire Rapids 8x DDR5-4800 = 307 GB/s per socket (spec), ~72% reached
        f_cpu=20
        * T,  # est.: AMX bf16 on 56 cores, well below its ~200 TFLOP/s peak for skinny matmuls
        c_cpu=5 * US,
        bw_gpu=3350 * GB,  # spec: H100 SXM5, 3.35 TB/s HBM3
        f_gpu=989 * T,  # spec: 989 TFLOP/s dense bf16
        c_gpu=5 * US,
        bw_pcie=56 * GB,  # DESIGN: PCIe 5.0 x16 host->device
        c_copy=10 * US,
        c_act=10 * US,
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
            "fp32": 18.9e6 / 958e-6,
            "bf16": 9.44e6 / 767e-6,
            "int8": 4.72e6 / 466e-6,
            "q8": 4.72e6 / 466e-6,
            "int4": 2.36e6 / 241e-6,
            "q4": 2.36e6 / 241e-6,
        },
    ),
}


# (VRAM, RAM) in GB of each profiled machine, for `hybridmoe plan`. VRAM: vendor spec. RAM: est.,
# a typical build of that class (desktop 64 GB, budget desktop 32 GB, server 512 GB).
MEMORY_GB: dict[str, tuple[float, float]] = {
    "rtx4090-ddr5": (24, 64),
    "rtx3090-ddr4": (24, 64),
    "rtx4060-8gb-ddr5": (8, 32),
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
