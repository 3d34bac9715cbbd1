"""How long one routed expert takes on the CPU, on the GPU, and to copy over PCIe.

The formulas (docs/architecture.md):

    t_cpu(n) = max(bytes / bw_cpu, flops(n) / f_cpu) + c_cpu
    t_gpu(n) = max(bytes / bw_gpu, flops(n) / f_gpu) + c_gpu
    t_copy   = bytes / bw_pcie + c_copy
    t_act(s, T) = (min(s, T) + s) * hidden * act_bytes / bw_pcie + 2 * c_act
                                # a layer's CPU experts' rows GPU->CPU, their outputs back

The CPU's kernels refine t_cpu (measured, fitted by `fit()`; named profiles keep the plain form):
below `cpu_gemm_from` tokens the weights are streamed once per token, the first pass from RAM and
the others from the caches (`t_rows`); from it on, streaming and arithmetic overlap only in part
(`cpu_overlap`, 1 = the max above, 0 = their sum).

A `CostModel` is the hardware constants plus the geometry of one expert (its bytes in the chosen
quantisation, its flops per token). Constants come from `fit()` over measured samples (the
calibration run, experts/run/calibrate.py, fitted by cost_fit.py) or from a named profile
(profiles.py); a profile is saved and loaded as JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.files import write_atomic
from hybridmoe.quant.formats import FORMATS

# Bytes per weight of each expert format, by the names the engine gives formats: GGUF's block
# formats carry a scale per block (q8_0 = 34 bytes per 32 weights, q4_k = 144 per 256, 4.5 bits;
# hybridmoe/quant/formats.py), the float formats none.
FLOAT_BYTES = {"f32": 4.0, "bf16": 2.0, "f16": 2.0}
# Older names, still taken: each means the format it names (q4 = q4_k), or a nominal width of a
# format the engine does not keep (fp8, int8, int4: the simulator's what-ifs).
ALIASES = {"fp32": "f32", "fp16": "f16", "q8": "q8_0", "q6": "q6_k", "q5": "q5_k", "q4": "q4_k"}
NOMINAL_BYTES = {"fp8": 1.0, "int8": 1.0, "int4": 0.5}
QUANT_BYTES = {
    **FLOAT_BYTES,
    **{f.name: f.nbytes / f.block for f in FORMATS.values()},
    **NOMINAL_BYTES,
}
QUANT_BYTES.update({alias: QUANT_BYTES[name] for alias, name in ALIASES.items()})
# Per-format CPU constants of a calibrated profile (CostModel.cpu_formats): the fields below.
CPU_FIELDS = (
    "bw_cpu", "f_cpu", "c_cpu", "bw_cpu_one", "c_cpu_one", "cpu_gemm_from", "cpu_caches",
    "bw_cpu_reread", "c_cpu_reread", "cpu_overlap",
)  # fmt: skip


def format_name(quant: str) -> str:
    """The engine's name of a format given by any name QUANT_BYTES takes (q4 -> q4_k)."""
    quant_bytes(quant)
    return ALIASES.get(quant, quant)


def quant_bytes(quant: str) -> float:
    if quant not in QUANT_BYTES:
        raise UserError(f"unknown quantisation {quant!r}; use one of {', '.join(QUANT_BYTES)}")
    return QUANT_BYTES[quant]


# 2: the CPU's row-by-row regime,
# cache re-reads and overlap (cpu_gemm_from, cpu_caches, cpu_overlap). 3: CPU constants per format
# (cpu_formats).
PROFILE_VERSION = 3


@dataclass
class CostModel:
    """Hardware constants (bytes/s, flop/s, s) plus the geometry of the expert being costed."""

    bw_cpu: float  # effective bytes/s one expert streams from RAM with all CPU threads
    f_cpu: float  # flop/s of the CPU expert kernel
    c_cpu: float  # fixed seconds per CPU expert call (dispatch, thread wake-up)
    bw_gpu: float = 0.0  # 0 = no GPU
    f_gpu: float = 0.0
    c_gpu: float = 0.0
    bw_pcie: float = 0.0
    c_copy: float = 0.0
    c_act: float = 0.0  # fixed seconds per activation transfer (one direction)
    # What bw_pcie and c_copy were measured from: "pinned" (what the runtime's copies read: its
    # staging ring, experts/run/host_staging.py), "" for a named profile. The same copies from
    # pageable memory, measured beside them (0 = not measured), for reference.
    copy_source: str = ""
    bw_pcie_pageable: float = 0.0
    c_copy_pageable: float = 0.0
    # Bytes the GPU expert timings rotated through, beyond the GPU's L2 (0 = not measured).
    gpu_rotate_bytes: float = 0.0
    name: str = ""
    # Effective CPU bandwidth per format when it differs from bw_cpu (dequantisation costs): the
    # named profiles' estimate, keyed by format_name; used where cpu_formats is empty.
    bw_cpu_by_quant: dict[str, float] = field(default_factory=dict)
    # A calibrated profile's CPU constants per expert format it measured (format name -> the
    # CPU_FIELDS): for_expert takes the expert's, and refuses a format the profile lacks.
    cpu_formats: dict[str, dict] = field(default_factory=dict)
    # One token runs a matrix-vector kernel that streams weights faster than the batched (GEMM)
    # kernel does at small n (docs/notes/2026-11-24-measurements-in-code.md); 0 = no separate
    # figure, bw_cpu for every n. Set by calibration.
    bw_cpu_one: float = 0.0
    # That kernel's fixed seconds per call (it skips the GEMM's set-up); used with bw_cpu_one.
    # None (profiles written before it existed) = c_cpu.
    c_cpu_one: float | None = None
    # Below this many tokens the CPU works row by row, one matrix-vector pass per token (MKL does at
    # n = 2, 3: the notes above, "cpu_gemm_from"). 2 = only n = 1.
    cpu_gemm_from: int = 2
    # Where the passes after the first re-read the weights from: [capacity bytes, bytes/s] per cache
    # level, innermost first (bandwidth 0 = not measured, as the next level out), then RAM at
    # bw_cpu_reread (0 = bw_cpu_one); plus a fixed cost per pass.
    cpu_caches: list[list[float]] = field(default_factory=list)
    bw_cpu_reread: float = 0.0
    c_cpu_reread: float = 0.0
    # Share of the smaller of (streaming, arithmetic) that the batched kernel hides behind the
    # larger: 1 = the roofline's max, 0 = their sum (measured near 0 on one thread: the notes,
    # "cpu_overlap").
    cpu_overlap: float = 1.0
    # What the machine charges besides the experts themselves (the simulator's physics; 0 = not
    # modelled): all the bytes/s DRAM delivers, shared by the CPU experts and the copies' DMA; the
    # floor of one small GPU kernel (launch and execution); one CPU<->GPU synchronisation a layer.
    bw_dram: float = 0.0
    c_kernel: float = 0.0
    c_sync: float = 0.0
    # Geometry, filled in by for_expert():
    expert_bytes: float = 0.0
    flops_per_token: float = 0.0
    hidden: int = 0
    act_bytes: float = 2.0  # activations travel as bf16
    quant: str = "bf16"

    @property
    def has_gpu(self) -> bool:
        return self.bw_gpu > 0 and self.bw_pcie > 0

    def for_expert(
        self, shape: ExpertShape, quant: str = "bf16", expert_bytes: float | None = None
    ) -> CostModel:
        """A copy of these constants costing one expert of `shape` stored as `quant` (any name
        QUANT_BYTES takes): `expert_bytes` as stored where known (a file's mix of formats), else
        the format's bytes per weight."""
        params = shape.params_per_expert()
        return replace(
            self.for_format(quant),
            expert_bytes=expert_bytes or params * quant_bytes(quant),
            flops_per_token=2.0 * params,  # one multiply-add per weight per token
            hidden=shape.hidden,
            quant=quant,
        )

    def for_format(self, quant: str) -> CostModel:
        """These constants with the CPU's for experts in `quant` (cpu_constants)."""
        return replace(self, **self.cpu_constants(quant))

    def cpu_constants(self, quant: str) -> dict:
        """The CPU fields for experts in `quant`: a calibrated profile's own for that format (an
        error where it did not measure it), else bw_cpu_by_quant's estimate."""
        name = format_name(quant)
        if not self.cpu_formats:
            return {"bw_cpu": self.bw_cpu_by_quant.get(name, self.bw_cpu)}
        if name not in self.cpu_formats:
            raise UserError(
                f"the cost profile has figures for {', '.join(self.cpu_formats)} experts, not "
                f"{name}; measure them with `hybridmoe calibrate --formats {name}` (--out FILE for "
                "a profile file)"
            )
        return dict(self.cpu_formats[name])

    def t_cpu(self, n: int) -> float:
        if self.bw_cpu_one and n < self.cpu_gemm_from:
            return self.t_rows(n)
        stream, compute = self.expert_bytes / self.bw_cpu, n * self.flops_per_token / self.f_cpu
        return stream + compute - self.cpu_overlap * min(stream, compute) + self.c_cpu

    def t_rows(self, n: int) -> float:
        """n matrix-vector passes: the first streams the expert from RAM, the others re-read it."""
        c = self.c_cpu if self.c_cpu_one is None else self.c_cpu_one
        first = self.expert_bytes / self.bw_cpu_one + c
        return (
            first + (n - 1) * (self.t_reread(self.expert_bytes) + self.c_cpu_reread)
            if n > 1
            else first
        )

    def t_reread(self, nbytes: float) -> float:
        """Seconds to stream `nbytes` again, from the innermost cache level that holds them all,
        else from RAM: a stream larger than a cache evicts itself before it comes round again
        (docs/notes/2026-11-24-measurements-in-code.md, "t_reread")."""
        fits = [bw for capacity, bw in self.cpu_caches if nbytes <= capacity]
        bw = next((bw for bw in fits if bw > 0), 0.0) or self.bw_cpu_reread or self.bw_cpu_one
        return nbytes / bw

    def t_gpu(self, n: int) -> float:
        if not self.has_gpu:
            return math.inf
        return (
            max(self.expert_bytes / self.bw_gpu, n * self.flops_per_token / self.f_gpu) + self.c_gpu
        )

    def t_copy(self) -> float:
        if not self.has_gpu:
            return math.inf
        return self.expert_bytes / self.bw_pcie + self.c_copy

    def t_act(self, rows: int, tokens: int | None = None) -> float:
        """The activation round trip of a layer whose CPU experts take `rows` token rows in all
        (the sum of their token counts) out of the layer's `tokens` (default `rows`): what the
        hybrid runtime moves (experts/run/hybrid_runtime.py `_run_cpu_side`). Up, one batched copy
        of min(rows, tokens) hidden rows: each CPU expert's rows one after another, or the whole
        layer input when that is smaller; back, one copy of every CPU expert's output rows, which
        the GPU adds in the CPU runtime's order. 0 without a GPU or without CPU experts."""
        if not self.has_gpu or rows == 0:
            return 0.0
        up, back = self.act_rows(rows, tokens)
        return (up + back) * self.hidden * self.act_bytes / self.bw_pcie + 2.0 * self.c_act

    def act_rows(self, rows: int, tokens: int | None = None) -> tuple[int, int]:
        """(rows up, rows back) of that round trip, as t_act counts them."""
        if rows == 0:
            return 0, 0
        return (rows if tokens is None else min(rows, tokens)), rows

    def copy_slowdown(self) -> float:
        """Seconds a second of one-token CPU expert work takes while a copy streams: the copy's
        DMA takes `bw_pcie` of the DRAM bandwidth the CPU streams its weights from (1.0 where
        that is not modelled: no GPU, or no `bw_dram`)."""
        if not (self.bw_dram and self.has_gpu) or self.expert_bytes <= 0:
            return 1.0
        stream = min(1.0, self.expert_bytes / self.bw_cpu / self.t_cpu(1))  # share streaming
        share = min(1.0, max(self.bw_dram - self.bw_pcie, 0.0) / self.bw_cpu)
        return stream / max(share, 1e-9) + (1.0 - stream)

    def hit_saving(self, n: int = 1) -> float:
        """Seconds a GPU hit saves over running the expert on the CPU."""
        return max(0.0, self.t_cpu(n) - self.t_gpu(n)) if self.has_gpu else 0.0

    def sized(self, expert_bytes: float, flops: float, n_tokens: int) -> CostModel:
        """This model for one call of `n_tokens` on an expert of `expert_bytes` costing `flops`."""
        return replace(self, expert_bytes=expert_bytes, flops_per_token=flops / max(n_tokens, 1))

    def without_gpu(self) -> CostModel:
        return replace(
            self,
            bw_gpu=0.0,
            f_gpu=0.0,
            c_gpu=0.0,
            bw_pcie=0.0,
            c_copy=0.0,
            c_act=0.0,
            copy_source="",
            bw_pcie_pageable=0.0,
            c_copy_pageable=0.0,
            gpu_rotate_bytes=0.0,
        )

    # ---- persistence -------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": "hybridmoe-cost-profile", "version": PROFILE_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        write_atomic(path, json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        """Version 1 profiles load too: the fields they lack default to the formulas they were
        fitted for."""
        known = {f for f in cls.__dataclass_fields__}
        missing = [k for k in ("bw_cpu", "f_cpu", "c_cpu") if k not in data]
        if data.get("format") != "hybridmoe-cost-profile" or missing:
            raise UserError(
                "this file is not a hybridmoe cost profile; write one with `hybridmoe calibrate "
                "--out FILE`"
            )
        model = cls(**{k: v for k, v in data.items() if k in known})
        if data.get("dtype") and not model.cpu_formats:  # calibrated before version 3: its dtype
            name = format_name({"float32": "f32", "bfloat16": "bf16"}.get(data["dtype"], "bf16"))
            model.cpu_formats = {name: {k: getattr(model, k) for k in CPU_FIELDS}}
        model.bw_cpu_by_quant = {ALIASES.get(k, k): v for k, v in model.bw_cpu_by_quant.items()}
        return model

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UserError(
                f"cost profile {path} does not exist; write it with `hybridmoe calibrate --out "
                f"{path}`"
            ) from None
        except json.JSONDecodeError:
            raise UserError(
                f"cost profile {path} is not valid JSON; write it again with `hybridmoe calibrate`"
            ) from None
        return cls.from_json(data)
