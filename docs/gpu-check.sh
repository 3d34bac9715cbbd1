#!/usr/bin/env bash
# What only a CUDA GPU can show, in one call of the device tool (docs/benchmarks.md, "The hybrid
# engine on a CUDA GPU"): the suite's CUDA tests, the Triton dequantise kernel's speed, `calibrate`
# on the GPU (PCIe copies, GPU experts per format), then decode on a random-weight
# Qwen3-30B-A3B-shaped Q4_K_M file driven by the OLMoE routing trace, policies cpu / static /
# hybrimoe / value at GPU expert budgets 5 / 10 / 25 / 50%, with the runtime's statistics (copies,
# CPU and GPU busy time, measured against predicted).
#
# Here, before the call (needs pip's registry; the files are git-ignored and travel as `carry`):
#     docs/gpu-check.sh prepare
#   .whl/  the packages hybridmoe imports that the GPU machine's image lacks, as wheels for its
#          Python 3.12 (pinned to the versions installed here)
#   .gpu/  the OLMoE-1B-7B routing trace, from ../shared/traces (not the project's to commit)
# There (the device tool; the script keeps itself under ~9 minutes on 16 cores):
#     run(command="bash docs/gpu-check.sh", carry=[".whl", ".gpu"], timeout_s=590)
# What comes back under $OUT: env.txt, tests.log, triton.txt, calibration.json, runs.txt, log.txt.
# Then here: `hybridmoe simulate --hardware calibration.json ...` puts the simulator beside runs.txt.
#
# A dry run on a CPU (the emulated accelerator, a small model):
#     DEVICE=emulated LAYERS=1 TOKENS=8 POLICIES=cpu,value BUDGETS=0.1 OUT=/tmp/gpu-dry docs/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
    set -e
    mkdir -p .git/info .gpu
    for p in /.whl/ /.gpu/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
    cp ../shared/traces/olmoe-1b-7b_299tok.jsonl .gpu/
    # name==version as installed here: the image has torch, triton, numpy, transformers, tokenizers,
    # safetensors, jinja2, tqdm, matplotlib, pytest (KINDS.md's package list), not these
    pins=$(python -m pip list --format freeze 2>/dev/null | grep -iE \
        '^(gguf|fastapi|starlette|pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|typing[-_]extensions|uvicorn|llguidance|anyio|sniffio)==')
    rm -rf .whl
    # shellcheck disable=SC2086
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
    du -sh .whl .gpu
    exit 0
fi

OUT=${OUT:-/tmp/gpu-check}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
LAYERS=${LAYERS:-16}        # decoder layers of the Qwen3-30B-A3B-shaped file (48 is the real depth)
TOKENS=${TOKENS:-64}        # decoded tokens a run
POLICIES=${POLICIES:-cpu,static,hybrimoe,value}
BUDGETS=${BUDGETS:-0.05,0.1,0.25,0.5}
TRACE=.gpu/olmoe-1b-7b_299tok.jsonl
MODEL=/tmp/gpu-check-q3-${LAYERS}l.gguf
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
exec 2>>"$OUT/log.txt"
start=$(date +%s)
say() { echo "[$(( $(date +%s) - start ))s] $*" >&2; }

export PYTHONPATH=$PWD
if [ -d .whl ] && ! $PY -c "import gguf, fastapi, llguidance" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || say "wheels: install failed"
fi

say "environment"
{
    date -u +%FT%TZ; uname -a; nproc; free -g | head -2
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
        --format=csv 2>&1
    $PY - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, p.total_memory // 2**20, "MiB", p.multi_processor_count, "SMs")
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: none")
from hybridmoe.native import quant
print("quant paths", quant.paths())
EOF
    lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-300
} > "$OUT/env.txt" 2>&1

say "CUDA tests"
timeout 200 $PY -m pytest -q -p no:cacheprovider -rs tests/test_placement.py \
    tests/test_device_check.py tests/test_calibrate.py tests/test_hybrid_runtime.py \
    tests/test_triton_dequant.py > "$OUT/tests.log" 2>&1
say "tests rc $?"

say "dequantise: Triton kernel against the torch ops"
timeout 90 $PY - > "$OUT/triton.txt" 2>&1 <<'EOF'
import time, torch
from hybridmoe.quant import dequant
from hybridmoe.quant.formats import named
from tests.test_triton_dequant import blocks

if not torch.cuda.is_available():
    raise SystemExit("no CUDA: nothing to time")

def timed(fn, n=50):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n

# one Qwen3-30B-A3B expert's gate and up (1536 x 2048) and down (2048 x 768)
for name in ("q4_k_x8", "q6_k_x8", "q8_0_x16", "q4_k"):  # as the slots hold them, and GGUF's rows
    fmt = named(name)
    for rows, cols in ((1536, 2048), (2048, 768)):
        data = blocks(name, rows, cols, seed=0).cuda()
        fast = timed(lambda: dequant.dequantize(data, fmt, cols, torch.bfloat16))
        present, dequant.triton_present = dequant.triton_present, lambda: False
        slow = timed(lambda: dequant.dequantize(data, fmt, cols, torch.bfloat16))
        dequant.triton_present = present
        gb = data.numel() / 1e9
        print(f"{name} {rows}x{cols}: triton {fast*1e6:.1f} us ({gb/fast:.0f} GB/s of blocks), "
              f"torch ops {slow*1e6:.1f} us, {slow/fast:.1f}x")
EOF
say "triton rc $?"

say "calibrate"
timeout 150 $PY -m hybridmoe calibrate --quick --expert-shape 2048x768 --formats bf16,q4_k,q6_k \
    --out "$OUT/calibration.json" > "$OUT/calibrate.txt" 2>&1
say "calibrate rc $?"
cal=(); [ -s "$OUT/calibration.json" ] && cal=(--calibration "$OUT/calibration.json")

say "model: $LAYERS layers, Q4_K_M"
[ -s "$MODEL" ] || timeout 150 $PY -m hybridmoe bench make-model --shape qwen3-30b-a3b \
    --layers "$LAYERS" --format gguf-q4_k_m --out "$MODEL" >&2
say "model rc $?"

say "decode runs"
for b in ${BUDGETS//,/ }; do
    for p in ${POLICIES//,/ }; do
        [ "$p" = cpu ] && [ "$b" != "${BUDGETS%%,*}" ] && continue  # cpu uses no budget: once
        [ $(( $(date +%s) - start )) -gt 540 ] && { say "out of time before $p $b"; break 2; }
        echo "== policy $p budget $b device $DEVICE layers $LAYERS" >> "$OUT/runs.txt"
        timeout 90 $PY -m hybridmoe generate --model "$MODEL" --device "$DEVICE" --policy "$p" \
            --gpu-expert-budget "$b" --routing-trace "$TRACE" "${cal[@]}" --max-tokens "$TOKENS" \
            --prompt "Where should each expert of this layer run" --stats \
            2>&1 | tr '\r' '\n' | grep -vE "^ *(loading|calibrating)|^ *$" >> "$OUT/runs.txt"
        say "$p $b rc $?"
    done
done
say "done"
