#!/usr/bin/env bash
# The GPU runs behind docs/gpu-results.md and docs/BENCHMARKS.md, from the repository root:
#
#   bash benchmarks/device.sh COMMAND [ARGS...]
#
# Commands (ARGS, when given, replace the command's default arguments):
#   tests [PYTEST ARGS]    build the kernels, then the GPU suite under one xdist worker (a crashing
#                          test is reported as that test and the rest go on)
#   demo [DEMO ARGS]       python -m cpindex demo
#   bench-kernel [ARGS]    python -m cpindex bench --kernel   (default: bf16,fp8,nvfp4, 20 iters)
#   bench-ab [ARGS]        python -m cpindex bench            (default: ipc vs collective, W = 4)
#   probe [VARIANT WORLD]  benchmarks/handshake_probe.py with CUDA_MODULE_LOADING=EAGER, then LAZY
#   profile FMT REQ CTX [T [W]]  Nsight Compute on benchmarks/profile_kernel.py (stall reasons
#                          too; W > 1: rank 0's share of W)
#   wgmma-probe            benchmarks/wgmma_probe.cu: the operand layouts and accumulation
#                          precision of Hopper's warpgroup mma, e4m3 and f16 (sm_90a), and the
#                          T = 8 tensor throughput of mma.sync and the warpgroup mma
#   all                    tests, demo, bench-kernel and bench-ab with their defaults
#
# Environment: OUT (results folder: logs, JSON, PNG; default /tmp/cpindex-device), WHEELS (a
# folder of wheels installed into /tmp/site when pydantic or pyyaml are missing; default .whl),
# TIMEOUT (seconds per step, overrides each command's own bound), CPINDEX_CACHE_DIR (kernel
# build cache, default /tmp/cpindex-cache). Prints each step's summary; full logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/cpindex-device}
WHEELS=${WHEELS:-.whl}
export CPINDEX_CACHE_DIR=${CPINDEX_CACHE_DIR:-/tmp/cpindex-cache} PYTHONUNBUFFERED=1
mkdir -p "$OUT"

setup() {
  if ! python3 -c "import pydantic, yaml" 2>/dev/null; then
    compgen -G "$WHEELS/*.whl" > /dev/null || {
      echo "pydantic/pyyaml missing and no wheels in $WHEELS" >&2
      return 1
    }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$WHEELS"/*.whl || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  # The device may hold an older .git than the tree it was sent: the kernel sources' hash
  # identifies the code (compare: cat cpindex/kernels/*.hip cpindex/kernels/*.h | sha256sum).
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown);" \
    "kernel sources: $(cat cpindex/kernels/*.hip cpindex/kernels/*.h | sha256sum | cut -c1-12)"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  elif command -v rocm-smi > /dev/null; then
    rocm-smi --showproductname | grep -i "card series" || true
  fi
  python3 -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| HIP', torch.version.hip, '| GPUs', torch.cuda.device_count())"
}

bounded() {  # bounded DEFAULT_SECONDS CMD...: the step under TIMEOUT (or its own default)
  local limit=${TIMEOUT:-$1}
  shift
  timeout "$limit" "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "(stopped after ${limit} s)"
  return $rc
}

build_kernels() {  # the tensor-core and the portable build, before anything is timed
  python3 -c "import torch; from cpindex import kernels; d = torch.device('cuda', 0); kernels.load(d); kernels.load(d, portable=True)"
}

plot_arg() {  # --plot FILE where matplotlib is importable (it needs cpindex[bench])
  if python3 -c "import matplotlib" 2>/dev/null; then
    echo "--plot $1"
  else
    echo "(no matplotlib here: no plot)" >&2
  fi
}

cmd_tests() {
  build_kernels || return 1
  local args=("$@")
  [ ${#args[@]} -eq 0 ] && args=(tests/test_kernel_gpu.py tests/test_transports_gpu.py tests/test_multigpu.py)
  bounded 300 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 4 \
    --timeout 120 --durations=3 "${args[@]}" > "$OUT/gpu-tests.log" 2>&1
  local rc=$?
  grep -E "passed|failed|FAILED|crashed|SKIPPED|s call|^E  " "$OUT/gpu-tests.log" | tail -20
  return $rc
}

cmd_demo() {
  bounded 60 python3 -m cpindex demo "$@" > "$OUT/demo.log" 2> "$OUT/demo.err"
  local rc=$?
  cat "$OUT/demo.log"
  return $rc
}

cmd_bench_kernel() {
  local args=("$@")
  [ ${#args[@]} -eq 0 ] && args=(--formats bf16,fp8,nvfp4 --iters 20)
  # shellcheck disable=SC2046
  bounded 200 python3 -m cpindex bench --kernel "${args[@]}" --out "$OUT/kernel.json" \
    $(plot_arg "$OUT/kernel.png") > "$OUT/kernel.txt" 2> "$OUT/kernel.err"
  local rc=$?
  cat "$OUT/kernel.txt"
  [ $rc -eq 0 ] || tail -5 "$OUT/kernel.err"
  return $rc
}

cmd_bench_ab() {
  local args=("$@")
  [ ${#args[@]} -eq 0 ] && args=(--world 4 --transports ipc,collective --formats nvfp4,fp8
    --rows 1,8,32 --context 8k,32k,128k --iters 30)
  # shellcheck disable=SC2046
  bounded 200 python3 -m cpindex bench "${args[@]}" --out "$OUT/ab.json" \
    $(plot_arg "$OUT/ab.png") > "$OUT/ab.txt" 2> "$OUT/ab.err"
  local rc=$?
  cat "$OUT/ab.txt"
  [ $rc -eq 0 ] || tail -5 "$OUT/ab.err"
  return $rc
}

cmd_probe() {
  local variant=${1:-full} world=${2:-2} mode rc=0
  for mode in EAGER LAZY; do  # the one-process world needs EAGER (docs/design.md, rule 3)
    CUDA_MODULE_LOADING=$mode bounded 30 python3 benchmarks/handshake_probe.py "$variant" "$world" \
      > "$OUT/probe-$mode.log" 2>&1 || rc=1
    grep -E "PASS|FAIL" "$OUT/probe-$mode.log" | sed "s/^/$mode: /" || echo "$mode: no result"
  done
  return $rc
}

cmd_profile() {
  [ $# -ge 3 ] || { echo "usage: device.sh profile FMT REQUESTS CONTEXT [QUERY_LEN [WORLD]]" >&2; return 2; }
  local name="ncu-$(IFS=-; echo "$*").txt"
  bounded 150 ncu --clock-control none -k regex:score_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \
    --section ComputeWorkloadAnalysis \
    --metrics "regex:^(smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld\.sum|smsp__inst_executed\.sum|sm__inst_executed_pipe_[a-z0-9_]+\.avg\.pct_of_peak_sustained_active)$" \
    python3 benchmarks/profile_kernel.py "$@" > "$OUT/$name" 2>&1
  grep -E "DRAM Throughput|Duration|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|inst_executed.sum|bank_conflicts" \
    "$OUT/$name"
  grep -E "issue_stalled" "$OUT/$name" | sort -k3 -g -r | head -8
  grep -E "inst_executed_pipe" "$OUT/$name" | sort -k3 -g -r | head -8
}

cmd_wgmma_probe() {
  bounded 120 nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o /tmp/wgmma_probe \
    benchmarks/wgmma_probe.cu || return 1
  bounded 30 /tmp/wgmma_probe
}

[ $# -ge 1 ] || { sed -n '2,23p' "$0"; exit 2; }
cmd=$1
shift
setup || exit 1
case $cmd in
  tests) cmd_tests "$@" ;;
  demo) cmd_demo "$@" ;;
  bench-kernel) cmd_bench_kernel "$@" ;;
  bench-ab) cmd_bench_ab "$@" ;;
  probe) cmd_probe "$@" ;;
  profile) cmd_profile "$@" ;;
  wgmma-probe) cmd_wgmma_probe ;;
  all)
    rc=0
    for step in tests demo bench_kernel bench_ab; do
      echo "== ${step//_/-}"
      "cmd_$step" || rc=1
    done
    exit $rc
    ;;
  *) echo "unknown command: $cmd (run without arguments for the list)" >&2; exit 2 ;;
esac
