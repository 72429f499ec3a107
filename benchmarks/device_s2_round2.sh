#!/usr/bin/env bash
# Session 2, second H200 call: GPU tests after the 10k-call test fix, the nvfp4 pairing change
# and the metadata prefetch; then kernel variants side by side; then ncu on the default build.
source benchmarks/device_setup.sh || exit 1
date -u
V=(nopf=CP_META_PREFETCH=0 b4=CP_BF16_BATCH=4 ctas5=CP_MIN_CTAS=5 loads=CP_MEASURE_LOADS_ONLY=1)
for v in "${V[@]}"; do  # variant builds on the CPU while the tests use the GPU
  CPINDEX_KERNEL_DEFINES="${v#*=}" python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0))" > "$OUT/build-${v%%=*}.log" 2>&1 &
done
python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0)); kernels.load(torch.device('cuda', 0), portable=True)"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 6 \
  --timeout 120 --durations=5 tests/test_kernel_gpu.py tests/test_transports_gpu.py \
  tests/test_multigpu.py > "$OUT/gpu-tests.log" 2>&1
grep -E "passed|failed|FAILED|crashed|s call|^E  " "$OUT/gpu-tests.log" | tail -14
wait; date -u
timeout 220 python3 benchmarks/kernel_variants.py --out "$OUT/variants" base= "${V[@]}" 2>&1 | grep -v Warn
date -u
for case in "nvfp4 32 131072" "bf16 32 131072" "nvfp4 1 131072"; do
  set -- $case
  timeout 60 ncu --clock-control none -k regex:score_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 benchmarks/profile_kernel.py $1 $2 $3 > "$OUT/ncu-$1-$2.txt" 2>&1
  grep -E "DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Theoretical Occ" "$OUT/ncu-$1-$2.txt" | sed "s/^/$1 $2: /"
done
date -u
