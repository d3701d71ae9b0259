#!/usr/bin/env bash
# Issue 5 on one multi-GPU host (2, 4 or 8 GPUs; NCCL, one rank per visible GPU), one command:
#
#   bash scripts/multi_gpu_suite.sh [STEP ...]      STEP: tests bench_tp ppo ppo_cp (default: all four)
#
#   tests     torchrun -m pytest tests/distributed on NCCL (MCORE_PPO_TEST_DIST_BACKEND=nccl,
#             MCORE_PPO_TEST_DEVICE=cuda, MCORE_PPO_TEST_BACKEND=triton)
#   bench_tp  scripts/bench_tp.py: the head alone on real vocab shards, TP = number of GPUs
#   ppo       scripts/bench_ppo.py --tp N: PPO steps, fused head vs the logits path
#   ppo_cp    scripts/bench_ppo.py at TP N/2 × CP 2 (needs N >= 4; skipped otherwise)
#
# Every step runs under its own `timeout` in its own session, so a hung collective cannot eat the
# call; a failed step does not stop the next; a summary is printed (and written) at the end. All
# logs and JSON go to ${OUT:-/tmp/mgpu}. Whole-call budget MGPU_BUDGET_S (default 570 s, under the
# device tool's 600 s): each step's limit is cut to what is left, and a step with < 30 s left is
# skipped. Per-step limits: MGPU_TIMEOUT_TESTS/_BENCH_TP/_PPO/_PPO_CP. MGPU_PPO_ARGS: extra
# bench_ppo.py arguments for both PPO steps, e.g. "--micro-batch-tokens 16384" (default 8192,
# with causal SDPA per packed sequence as the decoder's attention) or "--attention reference"
# (the tests' O(t²) attention; micro-batches then default to 4096 tokens).
#
# Wheels: the GPU host has torch + triton but no megatron-core or pytest. They are carried as
# Python 3.12 wheels in MGPU_WHEEL_DIR (default .gpu4, git-ignored) and installed with
# --no-deps into a --target site dir put on PYTHONPATH (as scripts/gpu_suite.sh does). The
# megatron_core wheel used is MGPU_MCORE_VERSION (default: the newest in the folder).
# MGPU_SKIP_INSTALL=1 uses what is importable already. Through the device tool, e.g.:
#   run(command="bash scripts/multi_gpu_suite.sh", carry=[".gpu4"], kind="nvidia-h200-x2")
#
# Without GPUs the suite stops at once (exit 2). MGPU_NPROC=N forces N ranks (a CPU dry run of the
# suite's mechanics: the NCCL steps then fail fast, bench_ppo runs its tiny gloo configuration).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

out=${OUT:-/tmp/mgpu}
mkdir -p "$out"
budget=${MGPU_BUDGET_S:-570}
start=$SECONDS
summary=()
failed=0

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests bench_tp ppo ppo_cp)
for s in "${steps[@]}"; do
  case "$s" in tests|bench_tp|ppo|ppo_cp) ;; *) echo "multi_gpu_suite: unknown step '$s' (tests bench_tp ppo ppo_cp)" >&2; exit 2 ;; esac
done

ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
ranks=${MGPU_NPROC:-$ngpu}
case "$ranks" in ''|*[!0-9]*) echo "multi_gpu_suite: MGPU_NPROC must be a positive integer, got '$ranks'" >&2; exit 2 ;; esac
if [ "$ranks" -lt 2 ]; then
  echo "multi_gpu_suite: $ngpu GPU(s) visible; this suite needs 2, 4 or 8 (one NCCL rank per GPU)" >&2
  exit 2
fi
if [ "$ngpu" -lt "$ranks" ]; then
  echo "multi_gpu_suite: WARNING: $ranks ranks but $ngpu GPU(s): NCCL steps will fail (dry run)" >&2
fi
cpus=$(nproc 2>/dev/null || echo 2)
threads=$((cpus / ranks))
[ "$threads" -ge 1 ] || threads=1
[ "$threads" -le 8 ] || threads=8
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}

# ---- (a) carried wheels
site=""
if [ "${MGPU_SKIP_INSTALL:-0}" != 1 ]; then
  wheel_dir=${MGPU_WHEEL_DIR:-.gpu4}
  shopt -s nullglob
  mcore_wheels=("$wheel_dir"/megatron_core-*.whl)
  other_wheels=()
  for w in "$wheel_dir"/*.whl; do
    case "$(basename "$w")" in megatron_core-*) ;; *) other_wheels+=("$w") ;; esac
  done
  shopt -u nullglob
  if [ ${#mcore_wheels[@]} -eq 0 ]; then
    echo "multi_gpu_suite: no megatron_core-*.whl in $wheel_dir (carry it: carry=[\"$wheel_dir\"])" >&2
    exit 2
  fi
  version=${MGPU_MCORE_VERSION:-$(for w in "${mcore_wheels[@]}"; do basename "$w" | cut -d- -f2; done | sort -V | tail -n 1)}
  wheel=$(for w in "${mcore_wheels[@]}"; do [ "$(basename "$w" | cut -d- -f2)" = "$version" ] && echo "$w"; done | head -n 1)
  if [ -z "$wheel" ]; then
    echo "multi_gpu_suite: no megatron_core $version wheel in $wheel_dir" >&2
    exit 2
  fi
  site=/tmp/mgpu_site_$version
  echo "== install: megatron-core $version + ${other_wheels[*]:-no other wheels} -> $site"
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheel" "${other_wheels[@]}" >"$out/install.log" 2>&1; then
    cat "$out/install.log" >&2
    echo "multi_gpu_suite: installing the wheels failed (log: $out/install.log)" >&2
    exit 2
  fi
fi
export PYTHONPATH="${site:+$site:}$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "== host: $ranks ranks, $ngpu GPU(s), $cpus CPUs, OMP_NUM_THREADS=$OMP_NUM_THREADS, out=$out"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  python3 - <<'EOF'
import importlib

for name in ("torch", "triton", "megatron.core", "pytest"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as err:  # report, the steps that need it will fail on their own
        print(f"{name}: not importable ({type(err).__name__}: {err})")
EOF
} 2>&1 | tee "$out/host.txt"

# run_step NAME LIMIT LOG CMD...: CMD in its own session under `timeout`, output to LOG (and stdout).
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 30 ]; then
    summary+=("$(printf '%-10s %-22s %6s  %s' "$name" "SKIPPED (budget)" "-" "$log")")
    failed=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS status=0
  setsid --wait timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1 || status=$?
  local took=$((SECONDS - t0)) verdict
  case "$status" in
    0) verdict="ok" ;;
    124|137) verdict="TIMEOUT after ${limit}s" ;;
    *) verdict="FAILED (exit $status)" ;;
  esac
  [ "$status" -eq 0 ] || failed=1
  tail -n "${MGPU_TAIL:-40}" "$log"
  summary+=("$(printf '%-10s %-22s %5ss  %s' "$name" "$verdict" "$took" "$log")")
}

torchrun_cmd=(python3 -m torch.distributed.run --standalone --nproc_per_node "$ranks")
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      # Rank 0's pytest report in tests.log; every rank's output under tests_ranks/.
      rm -rf "$out/tests_ranks"
      run_step tests "${MGPU_TIMEOUT_TESTS:-300}" "$out/tests_torchrun.log" \
        env MCORE_PPO_TEST_DIST_BACKEND=nccl MCORE_PPO_TEST_DEVICE=cuda MCORE_PPO_TEST_BACKEND=triton \
        MCORE_PPO_TEST_TIMEOUT="${MCORE_PPO_TEST_TIMEOUT:-120}" MCORE_PPO_ERROR_REPORT="$out/tests_errors.json" \
        "${torchrun_cmd[@]}" --log-dir "$out/tests_ranks" --redirects 3 \
        -m pytest tests/distributed -q -rs -p no:cacheprovider
      rank0=$(find "$out/tests_ranks" -path '*/0/stdout.log' 2>/dev/null | head -n 1)
      if [ -n "$rank0" ]; then
        cp "$rank0" "$out/tests.log"
        echo "-- rank 0 pytest report ($out/tests.log):"
        tail -n 60 "$out/tests.log"
      fi
      ;;
    bench_tp)
      run_step bench_tp "${MGPU_TIMEOUT_BENCH_TP:-120}" "$out/bench_tp.log" \
        "${torchrun_cmd[@]}" scripts/bench_tp.py --out "$out"
      ;;
    ppo)
      run_step ppo "${MGPU_TIMEOUT_PPO:-200}" "$out/bench_ppo_tp$ranks.log" \
        env PYTHONWARNINGS=ignore "${torchrun_cmd[@]}" scripts/bench_ppo.py --tp "$ranks" --out "$out" ${MGPU_PPO_ARGS:-}
      ;;
    ppo_cp)
      if [ "$ranks" -lt 4 ]; then
        summary+=("$(printf '%-10s %-22s %6s  %s' ppo_cp "SKIPPED (< 4 GPUs)" "-" "-")")
        continue
      fi
      run_step ppo_cp "${MGPU_TIMEOUT_PPO_CP:-200}" "$out/bench_ppo_tp$((ranks / 2))_cp2.log" \
        env PYTHONWARNINGS=ignore "${torchrun_cmd[@]}" scripts/bench_ppo.py --tp $((ranks / 2)) --cp 2 --out "$out" ${MGPU_PPO_ARGS:-}
      ;;
  esac
done

{
  echo
  echo "== multi_gpu_suite summary: $ranks ranks, $((SECONDS - start))s of ${budget}s, files in $out"
  printf '%s\n' "${summary[@]}"
} | tee "$out/summary.txt"
exit $failed
