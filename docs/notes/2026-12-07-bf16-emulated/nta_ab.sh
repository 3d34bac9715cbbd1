#!/bin/bash
DEMO=/root/.cache/hybridmoe/demo-smollm2-e16k8s768-v5
cd "$(dirname "$0")/../../.."
for th in 1 2; do
for r in 1 2 3; do
for nta in 1 0; do
  echo "== nta=$nta th=$th r=$r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
  python docs/notes/2026-12-07-bf16-emulated/nta_run.py $nta bench generate --model $DEMO --dtype bf16 --threads $th --prompt-len 512 --max-tokens 128 --repeats 3 --warmup 1 --json 2>/dev/null
done
done
done
