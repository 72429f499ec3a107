#!/usr/bin/env bash
# The GPU test suite as run on the lent H200 (results go to docs/gpu-results.md), then the demo.
source benchmarks/device_setup.sh || exit 1
date -u
build_kernels
gpu_suite "$OUT/gpu-tests.log"
python3 -m cpindex demo 2>&1 | grep -v Warning | tee "$OUT/demo.log" | tail -8
