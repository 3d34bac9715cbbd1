#!/bin/bash
# This CPU capped to AVX2 with AVX-VNNI on both sides (Intel's client cores from Alder Lake on): ours with
# the integer kernels' AVX-VNNI path and the bf16 kernels' AVX2 build, llama.cpp built without AVX-512 and
# with AVX-VNNI (llama-cpp-python 0.3.36: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON
# -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=ON" pip install
# --no-binary llama-cpp-python --no-deps --target /tmp/llama-avxvnni llama-cpp-python==0.3.36).
# Usage: avxvnni.sh OUTDIR FILE...   (each file at 1 and 2 threads, two rounds, alternating)
out=$1; shift
mkdir -p "$out"
export HYBRIDMOE_QUANT_ISA=avxvnni HYBRIDMOE_BF16_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
export PYTHONPATH=/tmp/llama-avxvnni
cd "$(dirname "$0")/../../.."
for r in 1 2; do
for th in 1 2; do
for f in "$@"; do
  b=$(basename "$f" .gguf)
  echo "== $b th=$th r=$r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  python -m hybridmoe bench generate --model "$f" --dtype bf16 --threads $th --prompt-len 512 \
    --max-tokens 128 --repeats 3 --warmup 1 --json --compare-llama-cpp 2>/dev/null > "$out/$b-$th-$r.json"
done
done
done
