#!/bin/bash
# Cascade Lake stand-in on this CPU: oneDNN capped at AVX512_CORE_VNNI (no bf16, no AMX), ATen at avx512,
# the bf16 kernels emulated (or off). A: fp32 (what --dtype auto picks there today); B: bf16 on the emulated kernels.
DEMO=/root/.cache/hybridmoe/demo-smollm2-e16k8s768-v5
export ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI ATEN_CPU_CAPABILITY=avx512 HYBRIDMOE_AMX=0
cd "$(dirname "$0")/../../.."
for th in 1 2; do
for r in 1 2; do
  echo "== fp32 torch th=$th r=$r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  HYBRIDMOE_BF16_ISA=off python -m hybridmoe bench generate --model $DEMO --dtype fp32 --threads $th --prompt-len 512 --max-tokens 128 --repeats 3 --warmup 1 --json 2>/dev/null
  echo "== bf16 emulated th=$th r=$r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  HYBRIDMOE_BF16_ISA=avx512f python -m hybridmoe bench generate --model $DEMO --dtype bf16 --threads $th --prompt-len 512 --max-tokens 128 --repeats 3 --warmup 1 --json 2>/dev/null
done
done
echo "== bf16 native (this CPU, oneDNN uncapped) $(date +%T)"
unset ONEDNN_MAX_CPU_ISA ATEN_CPU_CAPABILITY
python -m hybridmoe bench generate --model $DEMO --dtype bf16 --threads 1 --prompt-len 512 --max-tokens 128 --repeats 3 --warmup 1 --json 2>/dev/null
