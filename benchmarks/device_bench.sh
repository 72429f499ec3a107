#!/usr/bin/env bash
# The benchmarks as run on the lent H200 (results go to docs/BENCHMARKS.md).
source benchmarks/device_setup.sh || exit 1
date -u
python3 -m cpindex bench --kernel --formats bf16,fp8,nvfp4 --iters 20 \
  --out "$OUT/kernel.json" 2>&1 | grep -v Warning | tee "$OUT/kernel.log" | tail -52
python3 -m cpindex bench --world 4 --transports ipc,collective --formats nvfp4,fp8 \
  --rows 1,8,32 --context 8k,32k,128k --out "$OUT/ab.json" --plot "$OUT/ab.png" 2>&1 \
  | grep -v Warning | tee "$OUT/ab.log" | tail -24
