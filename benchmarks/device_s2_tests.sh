#!/usr/bin/env bash
# Session 2, first H200 call: the whole GPU suite after session 1's last fixes (the binding's
# GIL release, the cached validation config, the peer.py refactor), and the demo.
source benchmarks/device_setup.sh || exit 1
date -u
python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0)); kernels.load(torch.device('cuda', 0), portable=True)"
timeout 330 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 6 \
  --timeout 120 --durations=8 tests/test_kernel_gpu.py tests/test_transports_gpu.py \
  tests/test_multigpu.py > "$OUT/gpu-tests.log" 2>&1
timeout 30 python3 -m cpindex demo > "$OUT/demo.log" 2>&1
date -u
grep -E "passed|failed|FAILED|ERROR|SKIPPED|crashed|s call" "$OUT/gpu-tests.log" | tail -30
grep -v Warn "$OUT/demo.log" | tail -4
