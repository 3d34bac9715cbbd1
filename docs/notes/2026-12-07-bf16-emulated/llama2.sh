#!/bin/bash
cd "$(dirname "$0")/../../.."
for f in ${FILES:-q3-4l-gguf-q4_k_m q3-4l-gguf-q8_0}; do
  for t in 1 2; do
    echo "== $f t=$t $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    python -m hybridmoe bench generate --model ${MODELS:-/tmp/m}/$f.gguf --compare-llama-cpp --threads $t --prompt-len 512 --max-tokens 128 --repeats 3 --warmup 1 --json 2>/dev/null
  done
done
echo "== end $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
