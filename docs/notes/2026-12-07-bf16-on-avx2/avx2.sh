#!/bin/bash
# This CPU capped to AVX2 on both sides (docs/benchmarks.md, "On a CPU without AVX-512"): ours with the bf16
# kernels' AVX2 build (what --dtype auto picks there now: bf16), ours without them (HYBRIDMOE_BF16_ISA=off,
# fp32: what auto picked before), llama.cpp's AVX2 build (llama-cpp-python built without AVX-512 into
# /tmp/llama-avx2). Usage: [OFF=FILE,...] avx2.sh OUTDIR FILE...   (each file at 1 and 2 threads, two rounds,
# alternating; the runs without the bf16 kernels for the files named in OFF). With QUANT=avxvnni
# LLAMA=/tmp/llama-avxvnni: ours on the integer kernels' AVX-VNNI path against llama.cpp built with AVX-VNNI
# (CMAKE_ARGS as /tmp/llama-avx2's with -DGGML_AVX_VNNI=ON: Intel's client cores from Alder Lake on).
out=$1; shift
mkdir -p "$out"
export HYBRIDMOE_QUANT_ISA=${QUANT:-avx2} ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
export PYTHONPATH=${LLAMA:-/tmp/llama-avx2}
cd "$(dirname "$0")/../../.."
for r in 1 2; do
for th in 1 2; do
for f in "$@"; do
  b=$(basename "$f" .gguf)
  echo "== $b th=$th r=$r avx2 build $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  HYBRIDMOE_BF16_ISA=avx2 python -m hybridmoe bench generate --model "$f" --dtype bf16 --threads $th \
    --prompt-len 512 --max-tokens 128 --repeats 3 --warmup 1 --json --compare-llama-cpp 2>/dev/null > "$out/$b-avx2-$th-$r.json"
  [[ ",$OFF," == *",$f,"* ]] || continue
  echo "== $b th=$th r=$r without the bf16 kernels $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  HYBRIDMOE_BF16_ISA=off python -m hybridmoe bench generate --model "$f" --dtype fp32 --threads $th \
    --prompt-len 512 --max-tokens 128 --repeats 3 --warmup 1 --json 2>/dev/null > "$out/$b-off-$th-$r.json"
done
done
done
