#!/usr/bin/env bash
# Session 3, last H200 call: the new default (cp.async ring for bf16/fp8, CP_SMEM_RING=8192; no
# metadata prefetch) through the whole GPU suite, then the kernel sweep and transport A/B for
# docs/BENCHMARKS.md.
source benchmarks/device_setup.sh || exit 1
date -u
build_kernels
gpu_suite "$OUT/gpu-tests.log"
date -u
timeout 140 python3 -m cpindex bench --kernel --formats bf16,fp8,nvfp4 --iters 20 \
  --out "$OUT/kernel.json" --plot "$OUT/kernel.png" > "$OUT/kernel.log" 2>&1
grep -v Warn "$OUT/kernel.log" | tail -52
date -u
timeout 100 python3 -m cpindex bench --world 4 --transports ipc,collective --formats nvfp4,fp8 \
  --rows 1,8,32 --context 8k,32k,128k --iters 30 --out "$OUT/ab.json" --plot "$OUT/ab.png" \
  > "$OUT/ab.log" 2>&1
grep -v -e Warn -e "bench:" "$OUT/ab.log" | tail -22
date -u
