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
# One OpenMP/OpenBLAS thread per process: the tests' shapes are tiny and every core is already
# busy with another process (the xdist workers, the ranks, their subprocesses), where a second
# thread's spinning only burns CPU (measured on 2 cores: tests/backends 124 s -> 109 s of CPU,
# 144 s -> 111 s wall). torchrun ranks get one thread anyway.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# pytest-xdist, one worker per core (MCORE_PPO_TEST_WORKERS overrides; 0 = in this process); a
# module's tests stay on one worker (--dist loadfile), so its fixtures and reports stay whole.
# pytest-benchmark, where installed, is not used here and only warns under xdist.
# Files in the order xdist hands them out (--no-loadscope-reorder: by default xdist hands out
# the files with the most tests first, which puts the long subprocess files, few tests each,
# last; each worker starts with two files and takes the next as one finishes): first the files
# whose tests run subprocesses for a long time (torchrun, bash, fresh processes), longest first,
# so that the many short files fill the end instead of one long file running alone on one
# worker. Then every other test file of tests/ but tests/distributed, each once.
files=(
  tests/integrations/test_verl_main_ppo.py     # verl's own trainer: 5 main_ppo runs, Ray and a rollout each
  tests/harness/test_run_distributed_tests.py  # runner self-tests: 6 torchruns, deadlocks, a late start
  tests/harness/test_launch.py                 # launch.sh: the 4-rank demo, the parity failure, refusals
  tests/actor/test_distill_demo.py             # the 4-rank distillation demo
  tests/integrations/test_verl_real.py         # real verl in fresh processes
  tests/harness/test_multi_gpu_suite.py
  tests/harness/test_docs_snippets.py          # every Python block of the README and docs/, a process each
)
for path in tests/*/test_*.py tests/test_*.py; do
  case "$path" in tests/distributed/* | "tests/test_*.py") continue ;; esac
  case " ${files[*]} " in *" $path "*) ;; *) files+=("$path") ;; esac
done
single() {
  python -m pytest "${files[@]}" -q -rs -n "${MCORE_PPO_TEST_WORKERS:-auto}" --dist loadfile --no-loadscope-reorder \
    -p no:benchmark "$@"
}
multi() {
  python scripts/run_distributed_tests.py --nproc "${MCORE_PPO_TEST_RANKS:-4}" -- "$@"
}
ranks="${MCORE_PPO_TEST_RANKS:-4} ranks (${MCORE_PPO_TEST_DIST_BACKEND:-gloo})"

if [ "${MCORE_PPO_TEST_OVERLAP:-1}" = 1 ]; then
  # Both suites at once (MCORE_PPO_TEST_OVERLAP=0: one after the other); the multi-rank suite's
  # report is held back and printed after the single-process one's. Each leaves the CPU idle at
  # times (subprocess start-ups, rendezvous, the runner self-test's deadlocks and late start,
  # xdist's last file): on 2 cores a subset ran in 440 s together against 538 s one after the other.
  log=$(mktemp)
  pid=""
  trap '[ -z "$pid" ] || kill -TERM "$pid" 2>/dev/null; rm -f "$log"' EXIT
  multi "$@" >"$log" 2>&1 &
  pid=$!
  echo "== single-process suite (the multi-rank suite, $ranks, runs alongside)"
  single_status=0
  single "$@" || single_status=$?
  single_s=$SECONDS
  multi_status=0
  wait "$pid" || multi_status=$?
  pid=""
  echo "== multi-rank suite: $ranks"
  cat "$log"
  echo "== scripts/test.sh: ${SECONDS} s wall (the single-process suite ended at ${single_s} s)"
  [ "$single_status" -eq 0 ] || exit "$single_status"
  exit "$multi_status"
fi

echo "== single-process suite"
single "$@"
echo "== multi-rank suite: $ranks"
multi "$@"
echo "== scripts/test.sh: ${SECONDS} s wall"
