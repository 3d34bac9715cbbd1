"""Every tuning constant in one place: thresholds between code paths, and the knobs of the policies
and the predictor. Each was measured; the figures behind it are in
docs/notes/2026-11-24-measurements-in-code.md under the constant's name. None is read from the
environment or changed at run time: a setting users choose belongs in a config dataclass instead.

No torch here: experts/plan/ and sim/ read it too.
"""

# ---- where CPU work runs -----------------------------------------------------------------------

# Bytes of expert weights below which a layer's CPU experts run in the calling thread: handing them
# to the worker threads costs about 0.5 ms a layer on a loaded 2-core machine.
WORKERS_MIN_BYTES = 32 << 20

# Tokens up to which the weighted sum of a layer's experts is one index_add_ call (decode batches);
# above, the [T*K, H] terms outgrow the cache and a call per expert is faster.
FEW_TOKENS = 32

# Share of the memory available at load (MemAvailable) that a GGUF file's blocks may take when they
# are copied into the process's own memory in 2 MB pages (loader/free_memory.py CopyBudget,
# native/huge_pages.py; Q4_K rearranged into rows of eights there): the rest is left for the page
# cache of the blocks read in place beyond it, the KV cache and other processes.
COPY_SHARE_OF_FREE = 0.75

# Rows up to which oneDNN's fp32 linear beats torch's default kernel for weights streamed from RAM.
FEW_ROWS = 32

# Rows up to which the one-thread native bf16 kernel takes a dense projection when torch has more
# threads: oneDNN splits the work over its threads and overtakes it from about 16 rows.
THREADED_NATIVE_ROWS = 8

# Rows from which a product of bf16 rows with weights in blocks (not Q4_K in rows of eights, which
# the AMX-INT8 tiles take) dequantises the weight to bf16 and calls oneDNN instead of the integer
# kernels, where rows need not be computed as if alone (--deterministic off) and the CPU multiplies
# bf16 in hardware. `bench products`, 1 thread, Intel Xeon VM with AMX (2026-12-07): dequantise +
# oneDNN against ours at 96 / 128 / 256 tokens, Q8_0 0.85-0.95x / 0.60-0.74x / 0.38-0.40x of our
# time, Q6_K 1.50-1.54x / 1.11-1.24x / 0.59-0.65x (docs/benchmarks.md, "Prefill products").
DEQUANTISE_FROM_ROWS = 160

# Rows of an expert a training step's forward and backward compute at a time (a full tile), and the
# granule the rest is rounded up to and split in powers of two: every bf16 matmul of the expert
# backward then has one of six row counts, so oneDNN builds and keeps six kernels per shape rather
# than one per expert group size.
TRAIN_TILE_ROWS = 256
TRAIN_ROW_GRAIN = 8
# Rows of a frozen block-format matrix dequantised at once for the input gradient through it
# (quant/transposed.py): a tile's values are all that exist of it in floats (1 MB for 256 rows of
# 1,024 values in fp32). A multiple of 8: interleaved rows (8 or 16 a group) dequantise in whole
# eights.
TRAIN_DEQUANT_ROWS = 256
# The share of a layer's experts each token chooses from which a training step computes every
# expert for every token in four large products (experts/run/dense_experts.py) rather than each
# expert on its own rows: E / K times the multiply-adds, at a large product's speed. The demo
# (8 of 16) is faster so (docs/notes/2026-11-25-finetune-dense-experts.md); Qwen3-30B-A3B (8 of
# 128) would do 16x the work.
TRAIN_DENSE_EXPERT_SHARE = 0.25

# ---- calibration -------------------------------------------------------------------------------

# Bytes of expert copies a calibration rotates through, beyond any desktop or server CPU's
# last-level cache, so that every timed call streams its weights from RAM as a decode step does.
ROTATE_BYTES = 96e6

# Token counts up to which the cost-model fit looks for the end of the row-by-row CPU regime.
ROWS_UP_TO = 16

# The GPU an emulated accelerator pretends to be when the calibration measured none.
EMULATED_GPU = "rtx4090-ddr5"

# Bytes of experts a GPU calibration rotates through: beyond any GPU's L2 (96 MB on an RTX 4090,
# 50 MB on an H100, 126 MB on a B200), so that every timed expert streams from GPU memory as a
# cache miss does.
GPU_ROTATE_BYTES = 256e6

# ---- the bus -----------------------------------------------------------------------------------

# Pinned staging buffers (each the size of the largest expert) experts cross to the GPU by: one
# being filled from pageable memory while the one before it is copied, and one more so that the
# filling never waits for a DMA still in flight (experts/run/host_staging.py).
STAGING_DEPTH = 3

# ---- the planner -------------------------------------------------------------------------------

# Experts still being copied (late hits) up to which the planner weighs every GPU/CPU split of them
# exactly (a Pareto front, usually a few points); beyond, only the soonest-ready-first prefixes.
LATE_SUBSETS = 10

# What planning one MoE layer costs on one core, per policy: (distinct routed experts in the layer,
# microseconds the layer's experts wait for the plan, microseconds of the planner's deferred part
# beside them), at the Qwen3-30B-A3B shape for a decode batch of 1 and 8 and a 512-token prefill
# chunk: `hybridmoe bench planner` (docs/benchmarks.md, "Planner cost"). The simulator charges
# them, interpolated in the routed count. The future-knowing yardsticks are charged nothing.
PLANNER_US = {
    "cpu": ((8, 3.3, 4.6), (43.3281, 6.4, 5.7), (128, 14.8, 9.0)),
    "static": ((8, 15.7, 6.9), (43.3281, 44.3, 9.4), (128, 177.4, 23.8)),
    "fiddler": ((8, 5.4, 5.3), (43.3281, 13.4, 7.1), (128, 43.0, 14.4)),
    "hybrimoe": ((8, 40.3, 25.1), (43.3281, 109.4, 33.2), (128, 209.5, 67.1)),
    "lru": ((8, 36.8, 12.0), (43.3281, 94.6, 18.3), (128, 185.8, 30.2)),
    "lfu": ((8, 40.2, 17.2), (43.3281, 97.8, 24.9), (128, 187.4, 40.3)),
    "value": ((8, 39.4, 45.8), (43.3281, 99.7, 71.5), (128, 413.3, 146.2)),
}

# Small kernels one decoder layer's dense part runs on the GPU in decode (norms, q/k/v/o, q/k norms,
# rotary, attention, residual adds, router, its softmax and top-k, the weights' normalisation):
# llama.cpp's graph for a Qwen3-MoE layer, counted. The simulator charges the GPU's `c_kernel` for
# each (docs/benchmarks.md, "Simulator against published machines").
DENSE_KERNELS_PER_LAYER = 18

# ---- policies ----------------------------------------------------------------------------------

# Tokens in a batch from which llama.cpp's CUDA backend copies weights kept in host RAM to the GPU
# for an op rather than running it on the CPU (ggml-cuda.cu, `ggml_backend_cuda_offload_op`:
# min_batch_size = 32); the static policy stages copies from there, as llama.cpp --n-cpu-moe does.
LLAMA_CPP_OFFLOAD_BATCH = 32

# Background copies are queued only if they finish this many copy-times before the layer ends, so
# that the next layer's demand copies do not queue behind them (better for value and hybrimoe).
BACKGROUND_SLACK = 1.0

# The value policy's: its background copies may run on through the gap between layers (dense part,
# planning) until this many copy-times before the next layer's plan. 1: a copy queued last ends
# before the next layer's experts start, so it never slows them through DRAM (0.25 won on the
# tuning traces but lost on the held-out machines: docs/notes/2026-11-24-value-policy-2.md).
VALUE_BACKGROUND_SLACK = 1.0

# The same for the keys the look-ahead hint ranks top-k (ValuePolicy.hinted_slack): 0, up to the
# next layer's plan (chosen on the hinted tuning traces among 0.5, 0.25, 0, -0.5, -1:
# docs/notes/2026-11-25-look-ahead-hint.md). Traces without the hint never use it.
VALUE_HINTED_SLACK = 0.0

# The value policy copies a candidate in only if its expected distance to next use is this much
# shorter than its victim's (avoids churn between near-equals).
VALUE_MARGIN = 0.1

# Background candidates the value policy considers per layer.
VALUE_CANDIDATES_PER_LAYER = 4

# Upcoming keys the oracle offers per layer; the copy stream runs out long before.
ORACLE_LOOKAHEAD = 256

# ---- the predictor -----------------------------------------------------------------------------

# Visits over which an expert's frequency is counted (0 = all history): follows drifting popularity
# without forgetting a stable one.
PREDICTOR_WINDOW = 128

# Pseudo-observations at the expert's own frequency in each calibration cell.
PREDICTOR_PRIOR_WEIGHT = 4.0

# Pseudo-steps at the marginal rate in the cross-layer conditional, so an unseen pair scores its
# frequency.
CROSS_LAYER_PRIOR = 2.0

# Cell edges: steps since last use, frequency relative to top_k / num_experts, and the cross-layer
# score relative to the same.
AGE_EDGES = (1, 2, 3, 5, 9, 17)
FREQ_EDGES = (0.25, 0.5, 1.0, 2.0, 4.0)
LIFT_EDGES = (0.25, 0.5, 1.0, 2.0, 4.0)

# ---- the prefix cache's tiers ------------------------------------------------------------------

# Blocks waiting to be written to the tiers below the device pool; past it, new writes are dropped
# (counted in /metrics) rather than slowing the engine down.
PREFIX_WRITE_QUEUE_BLOCKS = 1024

# Seconds a remote tier that failed or timed out is left alone before it is tried again.
REMOTE_BACKOFF_S = 5.0

# Blocks asked of a remote store in one batch; the next batch is on its way while one is verified,
# and a Mooncake batch must fit its client's transfer buffer (64 MiB).
REMOTE_BATCH_BLOCKS = 16
