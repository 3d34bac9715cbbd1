#!/usr/bin/env bash
# OLD, NEW: the two trees (git worktree add /work/wt-old COMMIT); results in OUTDIR/{old,new}-N.json
# usage: serve_ab.sh OUTDIR PAIRS [serve args...]: alternating old/new servers, bench serve at 128- and 1024-token prompts, c1/c4/c8
out=$1; pairs=$2; shift 2
mkdir -p $out
for i in $(seq 1 $pairs); do
  for tree in old new; do
    dir=${OLD:-/work/wt-old}; [ $tree = new ] && dir=${NEW:-/work/main}
    port=$((10100 + RANDOM % 500))
    (cd $dir && PYTHONPATH=$dir exec python -m hybridmoe serve --port $port "$@" > $out/$tree-$i.server.log 2>&1) &
    spid=$!  # the server itself (exec): killed after its run
    for k in $(seq 1 120); do curl -s 127.0.0.1:$port/v1/models >/dev/null && break; sleep 1; done
    flock /tmp/hybridmoe-heavy.lock bash -c "cd $dir && PYTHONPATH=$dir python -m hybridmoe bench serve --url http://127.0.0.1:$port --prompt-lens 128,1024 --max-tokens 128 --concurrency 1,4,8 --vocab 49152 --seed 0 --json > $out/$tree-$i.json 2> $out/$tree-$i.err"
    kill $spid; wait $spid 2>/dev/null
    echo "$tree $i $(uptime | sed 's/.*average//')"
  done
done
