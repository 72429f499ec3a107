# Sourced at the start of every device run: carried wheels (pydantic is not on the device
# image), the repo on PYTHONPATH, a build cache outside the repo, unbuffered output.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CPINDEX_CACHE_DIR=/tmp/cpindex-cache
export OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
