#!/usr/bin/env bash
# cpindex's GPU tests and benchmarks on a GPU machine, every log and result kept in one folder
# beside a record of the machine and the code they ran on. From a clone:
#
#   bash benchmarks/device.sh [-o DIR] [-w WHEELS] [-t SECONDS] COMMAND [ARGS...]
#
# Options:
#   -o DIR      results folder: logs, JSON, plots, env.txt (default: ${TMPDIR:-/tmp}/cpindex-device)
#   -w WHEELS   a folder of wheels to install first (no index, no dependencies) into a private
#               folder put on PYTHONPATH: for machines without a package index (default: none)
#   -t SECONDS  time limit of each step (default: each command's own, below)
#
# Commands (ARGS, when given, replace the command's default arguments):
#   env                    the date, commit, kernel sources' digest, GPU, driver and torch; every
#                          command prints this first and writes it to DIR/env.txt
#   tests [PYTEST ARGS]    build the kernels, then the GPU tests (default: tests/*_gpu.py,
#                          test_triton_baseline.py, test_examples.py, test_multigpu.py; 900 s).
#                          With pytest-xdist installed they run in one worker process, so a test
#                          that kills the process is reported as that test and the rest go on
#   demo [ARGS]            python -m cpindex demo (60 s)
#   bench-kernel [ARGS]    python -m cpindex bench --kernel (default: bf16,fp8,nvfp4; 300 s)
#   bench-ab [ARGS]        python -m cpindex bench, the transport A/B (default: ipc against
#                          collective, W = 4; 300 s)
#   bench-gate [ARGS]      python -m cpindex bench --gate, the CP gate's crossover (default:
#                          nvfp4, W = 4: one process per GPU with 4 GPUs, else the one-process
#                          world on GPU 0; 300 s; no plot)
#   profile FMT REQUESTS CONTEXT [QUERY_LEN [WORLD]]
#                          Nsight Compute on benchmarks/profile_kernel.py: speed of light,
#                          occupancy, stall reasons per issued instruction, pipe use (150 s);
#                          FMT triton profiles the Triton bf16 scorer on the same problem
#   probe [VARIANT [WORLD]]  benchmarks/handshake_probe.py under CUDA_MODULE_LOADING=EAGER, then
#                          LAZY (docs/design.md, the one-process world, rule 3; 30 s each)
#   wgmma-probe            benchmarks/wgmma_probe.cu (nvcc, sm_90a): the warpgroup mma's operand
#                          layouts and accumulation precision (docs/kernel.md)
#   all                    tests, demo, bench-kernel and bench-ab with their defaults
#
# The bench commands add --out DIR/NAME.json, and (except bench-gate) --plot DIR/NAME.png where
# matplotlib is importable (pip install -e ".[bench]"). A step's summary is printed; its full
# log is in DIR.
# The kernel build cache is the library's (CPINDEX_CACHE_DIR, default ~/.cache/cpindex).
set -uo pipefail

usage() { sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; }

RESULTS=${TMPDIR:-/tmp}/cpindex-device
WHEELS=
LIMIT=
while getopts "o:w:t:h" opt; do
  case $opt in
    o) RESULTS=$OPTARG ;;
    w) WHEELS=$OPTARG ;;
    t) LIMIT=$OPTARG ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { usage >&2; exit 2; }
cmd=$1
shift

# Absolute paths before moving to the repository root, so relative ones mean the caller's.
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd) || exit 1
if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || { echo "-w: no folder $WHEELS" >&2; exit 2; }
  WHEELS=$(cd "$WHEELS" && pwd) || exit 2
fi
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

setup() {
  if [ -n "$WHEELS" ]; then
    local site=${TMPDIR:-/tmp}/cpindex-device-site
    compgen -G "$WHEELS/*.whl" > /dev/null || { echo "-w: no wheels in $WHEELS" >&2; return 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$WHEELS"/*.whl || return 1
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this clone's cpindex
  {
    # The digest names the kernel code a result ran (cpindex.kernels.build.sources_digest).
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC');" \
      "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown);" \
      "kernel sources: $(cat cpindex/kernels/*.hip cpindex/kernels/*.h | sha256sum | cut -c1-12)"
    if command -v nvidia-smi > /dev/null; then
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
    elif command -v rocm-smi > /dev/null; then
      rocm-smi --showproductname | grep -i "card series" || true
    fi
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| HIP', torch.version.hip, '| GPUs', torch.cuda.device_count())"
  } 2>&1 | tee "$RESULTS/env.txt"
}

bounded() {  # bounded DEFAULT_SECONDS CMD...: the step under -t (or its own default)
  local limit=${LIMIT:-$1}
  shift
  timeout "$limit" "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "(stopped after ${limit} s)"
  return $rc
}

has() { "$PY" -c "import $1" 2> /dev/null; }

build_kernels() {  # every format's tensor-core and portable build, before anything is timed
  "$PY" -c "import torch; from cpindex import kernels; d = torch.device('cuda', 0); [kernels.load(d, f, portable=p) for p in (False, True) for f in (None, 'bf16', 'fp8', 'nvfp4')]"
}

cmd_tests() {
  build_kernels || return 1
  local args=("$@") opts=(-q -p no:cacheprovider -rs --durations=5)
  [ ${#args[@]} -eq 0 ] && args=(tests/*_gpu.py tests/test_triton_baseline.py tests/test_examples.py
    tests/test_multigpu.py)
  has xdist && opts+=(-n 1 --max-worker-restart 4)
  has pytest_timeout && opts+=(--timeout 300)
  bounded 900 "$PY" -m pytest "${opts[@]}" "${args[@]}" > "$RESULTS/gpu-tests.log" 2>&1
  local rc=$?
  grep -E "passed|failed|FAILED|crashed|SKIPPED|s call|^E  " "$RESULTS/gpu-tests.log" | tail -20
  return $rc
}

cmd_demo() {
  bounded 60 "$PY" -m cpindex demo "$@" > "$RESULTS/demo.log" 2>&1
  local rc=$?
  cat "$RESULTS/demo.log"
  return $rc
}

run_bench() {  # run_bench NAME ARGS...: python -m cpindex bench ARGS, results as DIR/NAME.*
  local name=$1 plot=()
  shift
  if [ "$name" = gate ]; then
    :  # the gate sweep draws no plot: its table and JSON hold every figure
  elif has matplotlib; then
    plot=(--plot "$RESULTS/$name.png")
  else
    echo "(matplotlib not installed: no plot)"
  fi
  bounded 300 "$PY" -m cpindex bench "$@" --out "$RESULTS/$name.json" "${plot[@]}" \
    > "$RESULTS/$name.txt" 2> "$RESULTS/$name.err"
  local rc=$?
  cat "$RESULTS/$name.txt"
  [ $rc -eq 0 ] || tail -5 "$RESULTS/$name.err"
  return $rc
}

cmd_bench_kernel() {
  [ $# -eq 0 ] && set -- --formats bf16,fp8,nvfp4
  run_bench kernel --kernel "$@"
}

cmd_bench_ab() {
  [ $# -eq 0 ] && set -- --world 4 --transports ipc,collective --formats nvfp4,fp8
  run_bench ab "$@"
}

cmd_bench_gate() {
  [ $# -eq 0 ] && set -- --world 4 --formats nvfp4
  run_bench gate --gate "$@"
}

cmd_profile() {
  [ $# -ge 3 ] || { echo "usage: device.sh profile FMT REQUESTS CONTEXT [QUERY_LEN [WORLD]]" >&2; return 2; }
  local log
  log="$RESULTS/ncu-$(IFS=-; echo "$*").txt"
  bounded 150 ncu --clock-control none -k regex:scores?_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \
    --section ComputeWorkloadAnalysis \
    --metrics "regex:^(smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld\.sum|smsp__inst_executed\.sum|sm__inst_executed_pipe_[a-z0-9_]+\.avg\.pct_of_peak_sustained_active)$" \
    "$PY" benchmarks/profile_kernel.py "$@" > "$log" 2>&1
  local rc=$?
  grep -E "DRAM Throughput|Duration|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|inst_executed.sum|bank_conflicts" "$log"
  grep -E "issue_stalled" "$log" | sort -k3 -g -r | head -8
  grep -E "inst_executed_pipe" "$log" | sort -k3 -g -r | head -8
  return $rc
}

cmd_probe() {
  local variant=${1:-full} world=${2:-2} mode rc=0
  for mode in EAGER LAZY; do
    CUDA_MODULE_LOADING=$mode bounded 30 "$PY" benchmarks/handshake_probe.py "$variant" "$world" \
      > "$RESULTS/probe-$mode.log" 2>&1 || rc=1
    grep -E "PASS|FAIL" "$RESULTS/probe-$mode.log" | sed "s/^/$mode: /" || echo "$mode: no result"
  done
  return $rc
}

cmd_wgmma_probe() {
  local bin
  bin=$(mktemp -d)/wgmma_probe || return 1
  bounded 120 nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o "$bin" \
    benchmarks/wgmma_probe.cu || return 1
  bounded 30 "$bin" | tee "$RESULTS/wgmma-probe.txt"
}

case $cmd in
  env | tests | demo | bench-kernel | bench-ab | bench-gate | profile | probe | wgmma-probe | all) ;;
  *) echo "unknown command: $cmd (bash $0 -h lists them)" >&2; exit 2 ;;
esac
setup || exit 1
case $cmd in
  env) ;;
  tests) cmd_tests "$@" ;;
  demo) cmd_demo "$@" ;;
  bench-kernel) cmd_bench_kernel "$@" ;;
  bench-ab) cmd_bench_ab "$@" ;;
  bench-gate) cmd_bench_gate "$@" ;;
  profile) cmd_profile "$@" ;;
  probe) cmd_probe "$@" ;;
  wgmma-probe) cmd_wgmma_probe ;;
  all)
    rc=0
    for step in tests demo bench_kernel bench_ab; do
      echo "== ${step//_/-}"
      "cmd_$step" || rc=1
    done
    exit $rc
    ;;
esac
