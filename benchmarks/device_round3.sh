#!/usr/bin/env bash
# Third (short) H200 call of session 1: the transport tests after the binding's GIL release.
source benchmarks/device_setup.sh || exit 1
date -u
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs -n 1 --max-worker-restart 4 \
  --timeout 100 tests/test_transports_gpu.py > "$OUT/transport-tests.log" 2>&1
grep -E "passed|failed|FAILED|ERROR|crashed|^E  " "$OUT/transport-tests.log" | tail -15
