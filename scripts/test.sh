#!/usr/bin/env bash
# The project's test command: the single-process suite, then the multi-rank suite under
# torchrun (4 gloo ranks on CPU; the same tests run on GPUs). Extra args go to both pytests.
set -euo pipefail
cd "$(dirname "$0")/.."

ranks=${MCORE_PPO_TEST_RANKS:-4}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

echo "== single-process suite"
python -m pytest tests --ignore=tests/distributed -q "$@"

echo "== multi-rank suite: torchrun, $ranks ranks (gloo)"
# Every rank logs to a file; rank 0's report is printed, and every rank's if the run fails.
# setsid + timeout: a hung collective cannot outlive the budget, and every rank is killed.
status=0
setsid timeout --kill-after=30 "${MCORE_PPO_TORCHRUN_TIMEOUT:-1500}" \
  torchrun --standalone --nproc_per_node "$ranks" --log-dir "$logs" --redirects 3 \
  -m pytest tests/distributed -q -p no:cacheprovider "$@" || status=$?
if [ "$status" -ne 0 ]; then
  echo "== multi-rank suite failed (exit $status); logs of every rank follow"
  find "$logs" -name 'std*.log' | sort | while read -r log; do echo "--- $log"; tail -n 120 "$log"; done
  exit "$status"
fi
cat "$(find "$logs" -path '*/0/stdout.log' | head -n 1)"
