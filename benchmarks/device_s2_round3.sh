#!/usr/bin/env bash
# Session 2, third H200 call: GPU tests with the one-process world's dedicated streams; nvfp4
# batch variants (timed, and their kernel tests); then the full kernel sweep and transport A/B
# for docs/BENCHMARKS.md.
source benchmarks/device_setup.sh || exit 1
date -u
V=(nv4=CP_NVFP4_BATCH=4 nv2=CP_NVFP4_BATCH=2)
for v in "${V[@]}"; do
  CPINDEX_KERNEL_DEFINES="${v#*=}" python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0))" > "/tmp/build-${v%%=*}.log" 2>&1 &
done
python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0)); kernels.load(torch.device('cuda', 0), portable=True)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 6 \
  --timeout 120 --durations=5 tests/test_kernel_gpu.py tests/test_transports_gpu.py \
  tests/test_multigpu.py > "$OUT/gpu-tests.log" 2>&1
grep -E "passed|failed|FAILED|crashed|s call|^E  " "$OUT/gpu-tests.log" | tail -14
wait; date -u
timeout 90 python3 benchmarks/kernel_variants.py --out /tmp/variants --formats nvfp4 \
  --rows 1,8,32 --context 32k,128k,512k base= "${V[@]}" 2>&1 | grep -v Warn
for v in "${V[@]}"; do
  CPINDEX_KERNEL_DEFINES="${v#*=}" timeout 60 python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernel_gpu.py -k "nvfp4 and not portable" 2>&1 | tail -1 | sed "s/^/${v%%=*} kernel tests: /"
done
date -u
timeout 150 python3 -m cpindex bench --kernel --formats bf16,fp8,nvfp4 --iters 20 \
  --out "$OUT/kernel.json" --plot "$OUT/kernel.png" > "$OUT/kernel.log" 2>&1
grep -v Warn "$OUT/kernel.log" | tail -50
timeout 110 python3 -m cpindex bench --world 4 --transports ipc,collective --formats nvfp4,fp8 \
  --rows 1,8,32 --context 8k,32k,128k --iters 30 --out "$OUT/ab.json" --plot "$OUT/ab.png" \
  > "$OUT/ab.log" 2>&1
grep -v -e Warn -e "bench:" "$OUT/ab.log" | tail -22
date -u
