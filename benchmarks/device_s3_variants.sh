#!/usr/bin/env bash
# Session 3, second H200 call: kernel tests of the per-format metadata prefetch (bf16 on, fp8 and
# nvfp4 off) and of the L2-prefetch build; then variants side by side.
source benchmarks/device_setup.sh || exit 1
# (CP_L2_PREFETCH was removed after this run, as it lost: its l2_* variants now build the default.)
date -u
V=(allpf=CP_META_PREFETCH=1 l2_8k=CP_L2_PREFETCH=8192 l2_16k=CP_L2_PREFETCH=16384
   l2_32k=CP_L2_PREFETCH=32768 loads=CP_MEASURE_LOADS_ONLY=1)
for v in "${V[@]}"; do  # variant builds on the CPU while the tests use the GPU
  CPINDEX_KERNEL_DEFINES="${v#*=}" python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0))" > "$OUT/build-${v%%=*}.log" 2>&1 &
done
python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0)); kernels.load(torch.device('cuda', 0), portable=True)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 3 \
  --timeout 120 tests/test_kernel_gpu.py > "$OUT/kernel-tests.log" 2>&1
grep -E "passed|failed|FAILED|crashed|^E  " "$OUT/kernel-tests.log" | tail -8
wait; date -u
CPINDEX_KERNEL_DEFINES=CP_L2_PREFETCH=16384 timeout 150 python3 -m pytest -q -p no:cacheprovider \
  --timeout 120 tests/test_kernel_gpu.py -k "not portable" 2>&1 | tail -2 | sed "s/^/l2_16k tests: /"
date -u
timeout 300 python3 benchmarks/kernel_variants.py --out "$OUT/variants" --rows 1,32,128 \
  base= "${V[@]}" 2>&1 | grep -v Warn
date -u
