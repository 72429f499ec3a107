#!/usr/bin/env bash
# Second H200 call of session 1: all GPU tests again (nvfp4 widening changed), the nvfp4
# kernel sweep, and the transport A/B in the one-process world.
source benchmarks/device_setup.sh || exit 1
date -u
python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0)); kernels.load(torch.device('cuda', 0), portable=True)"
timeout 230 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 6 \
  --timeout 100 tests/test_kernel_gpu.py tests/test_transports_gpu.py tests/test_multigpu.py \
  > "$OUT/gpu-tests.log" 2>&1
timeout 60 python3 -m cpindex bench --kernel --formats nvfp4 --iters 20 \
  --out "$OUT/kernel-nvfp4.json" > "$OUT/kernel-nvfp4.log" 2>&1
timeout 150 python3 -m cpindex bench --world 4 --transports ipc,collective --formats nvfp4,fp8 \
  --rows 1,8,32 --context 8k,32k,128k --iters 30 --out "$OUT/ab.json" --plot "$OUT/ab.png" \
  > "$OUT/ab.log" 2>&1
grep -E "passed|failed|FAILED|ERROR|SKIPPED|crashed" "$OUT/gpu-tests.log" | tail -20
grep -v Warn "$OUT/kernel-nvfp4.log" | tail -18; grep -v -e Warn -e "bench:" "$OUT/ab.log" | tail -24
