#!/usr/bin/env bash
# Everything the H200 session needs in one call (device starts are scarce): GPU tests, the
# demo, the kernel sweep and the transport A/B, each bounded so partial logs still come back.
# Tests run in an xdist worker so a crash is reported per test and the rest still run.
source benchmarks/device_setup.sh || exit 1
date -u
python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0)); kernels.load(torch.device('cuda', 0), portable=True)"
timeout 250 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 6 \
  --timeout 100 tests/test_kernel_gpu.py tests/test_transports_gpu.py tests/test_multigpu.py \
  > "$OUT/gpu-tests.log" 2>&1
timeout 30 python3 -m cpindex demo > "$OUT/demo.log" 2>&1
timeout 140 python3 -m cpindex bench --kernel --formats bf16,fp8,nvfp4 --iters 20 \
  --out "$OUT/kernel.json" > "$OUT/kernel.log" 2>&1
timeout 100 python3 -m cpindex bench --world 4 --transports ipc,collective --formats nvfp4,fp8 \
  --rows 1,8,32 --context 8k,32k,128k --iters 30 --out "$OUT/ab.json" --plot "$OUT/ab.png" \
  > "$OUT/ab.log" 2>&1
grep -E "passed|failed|FAILED|ERROR|SKIPPED|crashed" "$OUT/gpu-tests.log" | tail -20
grep -v Warn "$OUT/demo.log" | tail -3
grep -v Warn "$OUT/kernel.log" | tail -50; grep -v -e Warn -e "bench:" "$OUT/ab.log" | tail -22
