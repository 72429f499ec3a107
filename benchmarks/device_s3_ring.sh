#!/usr/bin/env bash
# Session 3, third H200 call: kernel tests of the cp.async ring build (CP_SMEM_RING), then the
# ring variants against the shipped build side by side.
source benchmarks/device_setup.sh || exit 1
# (`base` was the register path then; CP_SMEM_RING=8192 is the default since.)
date -u
V=(sm8k=CP_SMEM_RING=8192 sm4k=CP_SMEM_RING=4096 "sm8k_nopf=CP_SMEM_RING=8192 CP_META_PREFETCH=0"
   loads=CP_MEASURE_LOADS_ONLY=1)
for v in "${V[@]}"; do  # variant builds on the CPU while the base build is made
  CPINDEX_KERNEL_DEFINES="${v#*=}" python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0))" > "$OUT/build-${v%%=*}.log" 2>&1 &
done
python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0))"
wait; date -u
for d in "CP_SMEM_RING=8192" "CP_SMEM_RING=4096"; do
  CPINDEX_KERNEL_DEFINES="$d" timeout 150 python3 -m pytest -q -p no:cacheprovider \
    --timeout 120 tests/test_kernel_gpu.py -k "not portable" > "$OUT/tests-${d#*=}.log" 2>&1
  grep -E "passed|failed|^E  " "$OUT/tests-${d#*=}.log" | tail -4 | sed "s/^/$d: /"
done
date -u
timeout 300 python3 benchmarks/kernel_variants.py --out "$OUT/variants" --rows 1,32,128 \
  base= "${V[@]}" 2>&1 | grep -v Warn
date -u
