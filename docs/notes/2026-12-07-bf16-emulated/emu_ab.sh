#!/bin/bash
# this CPU (AVX512-BF16): the native build against the emulated one, demo model, bf16
DEMO=/root/.cache/hybridmoe/demo-smollm2-e16k8s768-v5
cd "$(dirname "$0")/../../.."
for th in 1 2; do
for r in 1 2; do
for isa in avx512bf16 avx512f; do
  echo "== $isa th=$th r=$r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  HYBRIDMOE_BF16_ISA=$isa python -m hybridmoe bench generate --model $DEMO --dtype bf16 --threads $th --prompt-len 512 --max-tokens 128 --repeats 3 --warmup 1 --json 2>/dev/null
done
done
done
