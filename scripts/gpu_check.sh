#!/usr/bin/env bash
# One prepared call on a lent GPU machine (the device tool): the GPU suite, then the GPU benchmark, logs under $OUT.
# The machine's image has torch but not these pure-Python wheels; put them in .whl/ first (git-ignored there):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl hydra-core==1.3.8 omegaconf==2.3.1 submitit==1.5.4
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3      (an sdist only)
# and carry .whl. Warm-up compile logs (W...) are left out of the logs.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
timeout 240 python3 -m pytest gpu_tests -n 0 -q -p no:cacheprovider 2>&1 | grep -v "^W1" | tee "$OUT/gpu_tests.log"
timeout 240 python3 benchmarks/gpu.py rounds=2 "$@" 2>&1 | grep -v "^W1" | tee "$OUT/bench.log"
