# Sourced at the start of every device run: carried wheels (pydantic is not on the device
# image), the repo on PYTHONPATH, a build cache outside the repo, unbuffered output.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CPINDEX_CACHE_DIR=/tmp/cpindex-cache
export OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"

# Builds the default kernels (tensor-core and portable) before anything is timed.
build_kernels() {
  python3 -c "import torch; from cpindex import kernels; d = torch.device('cuda', 0); kernels.load(d); kernels.load(d, portable=True)"
}

# The GPU suite under one xdist worker, so that a crashing test is reported as that test and the
# rest go on: gpu_suite LOG [extra pytest arguments]. Prints the summary lines.
gpu_suite() {
  local log=$1
  shift
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 4 \
    --timeout 120 --durations=3 "$@" tests/test_kernel_gpu.py tests/test_transports_gpu.py \
    tests/test_multigpu.py > "$log" 2>&1
  grep -E "passed|failed|FAILED|crashed|s call|^E  " "$log" | tail -12
}
