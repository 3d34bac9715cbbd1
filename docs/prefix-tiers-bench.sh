#!/usr/bin/env bash
# The benchmark of docs/benchmarks.md, "Prefix cache tiers": the demo model served with the tiers
# on and off, measured by `hybridmoe bench serve --scenario ...`. Results (JSON) go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/prefix-bench}; rm -rf $OUT; mkdir -p $OUT
HM="python -m hybridmoe"
B="$HM bench serve --vocab 49152 --seed 0 --json"
U=http://127.0.0.1
start() { local port=$1; shift; $HM serve --port $port "$@" > $OUT/serve-$port.log 2>&1 & echo $! > $OUT/pid-$port
          until curl -sf $U:$port/health >/dev/null; do sleep 0.5; done; }
stop() { kill $(cat $OUT/pid-$1); wait $(cat $OUT/pid-$1) 2>/dev/null || true; }
echo "start $(date -u +%FT%TZ) load $(cat /proc/loadavg)" > $OUT/meta
# 1. disk tier: the prompts before a restart, then TTFT after it
start 10041 --prefix-cache-dir $OUT/kv
$B --url $U:10041 --warm-url $U:10041 --warm-only --scenario cached-prefix --repeats 5 > /dev/null
stop 10041
start 10041 --prefix-cache-dir $OUT/kv
$B --url $U:10041 --scenario cached-prefix --repeats 5 > $OUT/disk-restart.json
stop 10041
echo "disk done $(date -u +%T) load $(cat /proc/loadavg)" >> $OUT/meta
# 2. remote tier, Redis: prompts to replica A, TTFT on replica B
redis-server --port 10049 --bind 127.0.0.1 --save "" --appendonly no --maxmemory 4gb \
  --maxmemory-policy allkeys-lru > $OUT/redis.log 2>&1 & RP=$!
sleep 1
start 10042 --prefix-cache-remote redis://127.0.0.1:10049/0
start 10043 --prefix-cache-remote redis://127.0.0.1:10049/0
$B --url $U:10043 --warm-url $U:10042 --scenario cached-prefix --repeats 5 > $OUT/redis-replica.json
stop 10042; stop 10043; kill $RP; wait $RP 2>/dev/null || true
echo "redis done $(date -u +%T) load $(cat /proc/loadavg)" >> $OUT/meta
# 3. remote tier, Mooncake Store: master + metadata server, a store process, two replicas
MC=$(python -c "import mooncake, os; print(os.path.dirname(mooncake.__file__))")
export MC_TCP_BIND_ADDRESS=127.0.0.1
$MC/mooncake_master --rpc_port=10050 --rpc_address=127.0.0.1 --enable_http_metadata_server=true \
  --http_metadata_server_host=127.0.0.1 --http_metadata_server_port=10051 \
  --metrics_host=127.0.0.1 --metrics_port=10052 > $OUT/master.log 2>&1 & MP=$!
sleep 1
$MC/mooncake_client --host=127.0.0.1 --port=10053 --global_segment_size=2GB \
  --master_server_address=127.0.0.1:10050 --metadata_server=http://127.0.0.1:10051/metadata \
  --protocol=tcp > $OUT/store.log 2>&1 & SP=$!
sleep 2
MURL="mooncake://127.0.0.1:10050?metadata=http://127.0.0.1:10051/metadata"
start 10044 --prefix-cache-remote "$MURL"
start 10045 --prefix-cache-remote "$MURL"
$B --url $U:10045 --warm-url $U:10044 --scenario cached-prefix --repeats 5 > $OUT/mooncake-replica.json
stop 10044; stop 10045; kill $SP $MP; wait $SP $MP 2>/dev/null || true
echo "mooncake done $(date -u +%T) load $(cat /proc/loadavg)" >> $OUT/meta
# 4. multi-turn chat, 4 conversations in a pool of 4096 tokens: tiers off, then RAM on
MT="--scenario multi-turn --conversations 4 --turns 6 --prefix-len 400 --turn-len 150 --max-tokens 32"
start 10046 --kv-cache-tokens 4096
$B --url $U:10046 $MT > $OUT/multiturn-off.json; stop 10046
start 10046 --kv-cache-tokens 4096 --prefix-cache-ram 2GB
$B --url $U:10046 $MT > $OUT/multiturn-ram.json; stop 10046
echo "multi-turn done $(date -u +%T) load $(cat /proc/loadavg)" >> $OUT/meta
# 5. a 2,000-token system prompt shared by 32 requests, 4 at a time: a fresh server without tiers,
#    then one with a disk tier restarted after serving the same requests
SP2="--scenario shared-prefix --prefix-len 2000 --requests 32 --at-once 4 --tail-len 32 --max-tokens 16"
start 10047
$B --url $U:10047 $SP2 > $OUT/shared-off.json; stop 10047
start 10047 --prefix-cache-dir $OUT/kv2
$B --url $U:10047 $SP2 > /dev/null; stop 10047
start 10047 --prefix-cache-dir $OUT/kv2
$B --url $U:10047 $SP2 > $OUT/shared-disk.json; stop 10047
echo "end $(date -u +%T) load $(cat /proc/loadavg)" >> $OUT/meta
