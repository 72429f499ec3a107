#!/usr/bin/env bash
# The GPU test suite as run on the lent H200 (results go to docs/gpu-results.md).
source benchmarks/device_setup.sh || exit 1
date -u
python3 -m pytest -q -p no:cacheprovider -rs --timeout 300 tests/test_kernel_gpu.py \
  tests/test_transports_gpu.py tests/test_multigpu.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
python3 -m cpindex demo 2>&1 | grep -v Warning | tee "$OUT/demo.log" | tail -8
