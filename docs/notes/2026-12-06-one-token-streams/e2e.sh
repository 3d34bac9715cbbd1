# e2e A/B: decode tok/s of bench generate (ours only), two trees alternating, each run under the lock.
# Usage: OLD=/path/to/old/tree NEW=/path/to/new/tree bash e2e.sh MODEL.gguf THREADS PAIRS
f=$1; t=$2; n=$3
for i in $(seq $n); do
  for tree in "$OLD" "$NEW"; do
    r=$(cd $tree && PYTHONPATH=$tree flock /tmp/hybridmoe-heavy.lock python -m hybridmoe bench generate --model $f --threads $t --prompt-len 512 --max-tokens 128 --repeats 3 --warmup 1 --json 2>/dev/null | python -c "import json,sys; d=json.load(sys.stdin); h=d.get('hybridmoe', d); print('%.1f %.1f' % (h['prefill_tps'], h['decode_tps']))")
    echo "$tree t=$t $r load=$(cut -d' ' -f1 /proc/loadavg)"
  done
done
