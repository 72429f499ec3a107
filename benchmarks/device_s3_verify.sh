#!/usr/bin/env bash
# For the next session's first H200 call: does eager module loading cure the one-process stall?
# The whole GPU suite (tests/conftest.py sets CUDA_MODULE_LOADING=EAGER), the 10,000-call test
# three more times, and the probe that failed in session 2 with and without eager loading.
source benchmarks/device_setup.sh || exit 1
date -u
build_kernels
gpu_suite "$OUT/gpu-tests.log"
for i in 1 2 3; do
  timeout 60 python3 -m pytest -q -p no:cacheprovider --timeout 50 \
    tests/test_transports_gpu.py -k many_consecutive 2>&1 | tail -1 | sed "s/^/repeat $i: /"
done
for mode in EAGER LAZY; do
  for v in "full 2" "full 4"; do
    CUDA_MODULE_LOADING=$mode timeout 25 python3 benchmarks/handshake_probe.py $v 2>&1 \
      | grep -E "PASS|FAIL" | sed "s/^/$mode /" || echo "$mode $v: no result"
  done
done
date -u
