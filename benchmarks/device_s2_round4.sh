#!/usr/bin/env bash
# Session 2, fourth H200 call: the transport tests after the tests stopped issuing
# device-to-device memcpys between pushes; the 10,000-call test three more times.
source benchmarks/device_setup.sh || exit 1
date -u
python3 -c "import torch; from cpindex import kernels; kernels.load(torch.device('cuda', 0))"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 6 \
  --timeout 120 --durations=4 tests/test_transports_gpu.py > "$OUT/transport-tests.log" 2>&1
grep -E "passed|failed|FAILED|crashed|s call|^E  " "$OUT/transport-tests.log" | tail -12
for i in 1 2 3; do
  timeout 60 python3 -m pytest -q -p no:cacheprovider --timeout 50 \
    tests/test_transports_gpu.py -k many_consecutive 2>&1 | tail -1 | sed "s/^/repeat $i: /"
done
date -u
