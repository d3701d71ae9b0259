#!/usr/bin/env bash
# The project's test command: the single-process suite, then the multi-rank suite (4 gloo ranks
# on CPU; the same tests run over NCCL on GPUs, scripts/multi_gpu_suite.sh). Extra args go to
# both pytests.
#
# The multi-rank suite runs every test file in one torchrun (scripts/run_distributed_tests.py:
# one Megatron import and one rendezvous per rank): every rank's failure report and stack is
# printed even if another rank hangs, and tests a failure kept from running are run again in a
# fresh torchrun; the summary still reports each file.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== single-process suite"
# pytest-xdist, one worker per core (MCORE_PPO_TEST_WORKERS overrides; 0 = in this process); a
# module's tests stay on one worker (--dist loadfile), so its fixtures and reports stay whole.
# pytest-benchmark, where installed, is not used here and only warns under xdist.
python -m pytest tests --ignore=tests/distributed -q -rs -n "${MCORE_PPO_TEST_WORKERS:-auto}" --dist loadfile -p no:benchmark "$@"

echo "== multi-rank suite: ${MCORE_PPO_TEST_RANKS:-4} ranks (${MCORE_PPO_TEST_DIST_BACKEND:-gloo})"
python scripts/run_distributed_tests.py --nproc "${MCORE_PPO_TEST_RANKS:-4}" -- "$@"
