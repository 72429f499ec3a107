#!/usr/bin/env bash
# Session 2, fifth H200 call: what stalls the one-process handshake in the 10,000-call test.
source benchmarks/device_setup.sh || exit 1
python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0))"
for v in "pushonly 4" "full 4" "synceach 4" "onegrid 4" "full 2"; do
  timeout 25 python3 benchmarks/handshake_probe.py $v 2>&1 | grep -E "PASS|FAIL" || echo "$v: no result (hung past 25 s)"
done
CUDA_DEVICE_MAX_CONNECTIONS=32 timeout 25 python3 benchmarks/handshake_probe.py full 4 2>&1 | grep -E "PASS|FAIL" | sed 's/^/conn32 /'
date -u
