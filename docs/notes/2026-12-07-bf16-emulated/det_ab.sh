#!/bin/bash
# A/B of bench determinism: OLD tree (fma pairs on at every row count) vs NEW (vdpbf16ps on AMD)
for r in 1 2; do
  for t in ${OLD:?a worktree of 5eb798e} "$(pwd)"; do
    echo "== $t round $r $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $t && PYTHONPATH=$t python -m hybridmoe bench determinism --rounds 2 --json 2>/dev/null | tail -1)
  done
done
