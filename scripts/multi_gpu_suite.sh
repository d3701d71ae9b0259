#!/usr/bin/env bash
# The real training loop on one multi-GPU host (2, 4 or 8 GPUs; NCCL, one rank per GPU), in steps:
#
#   bash scripts/multi_gpu_suite.sh [STEP ...]
#
#   gpu1      pytest tests/gpu/test_gpu_attention.py: SdpaAttention's flash varlen path (one GPU)
#   attn      scripts/bench_attention.py: core attention on new vs seen sequence lengths (one GPU)
#   tests     scripts/run_distributed_tests.py over NCCL, every rank (MCORE_PPO_TEST_BACKEND=triton):
#             the whole tests/distributed suite, one torchrun per file, failures isolated
#   ppo       scripts/bench_ppo.py --tp N (SP): fused head vs the logits path, warmed A B B A timing
#   ppo_half  scripts/bench_ppo.py --tp N/2 (SP) × DP 2 (N >= 4)
#   ppo_cp    scripts/bench_ppo.py --tp N/2 --cp 2 (SP where TP > 1), CP inside the model, plus
#             --long-context MGPU_LONG_CONTEXT (default 16384,32768,65536)
#   tp        scripts/bench_tp.py at TP N: the head alone on real vocab shards, per rank, with its
#             collectives' share and the scaling against rank 0's TP 1 (MGPU_TP_SHAPES, default
#             "3584x152064 8192x128256": hidden x vocab, Qwen-7B and Llama-70B)
#   ppo_tp1   scripts/bench_ppo.py on one GPU (TP 1)
#   maxmb     scripts/bench_ppo.py --max-micro-batch MGPU_MAX_MB on one GPU: the largest
#             micro-batch each variant runs before running out of memory
#   (default: gpu1 attn tests ppo ppo_cp)
#
# Every step runs under its own `timeout` in its own session, so a hang cannot eat the call; a
# failed step does not stop the next; a summary is printed at the end. Whole-call budget
# MGPU_BUDGET_S (default 570 s, under the device tool's 600 s): each step's limit is cut to what
# is left, and a step with < 30 s left is skipped. MGPU_PPO_ARGS: extra bench_ppo.py arguments.
#
# Logs and JSON are written under MGPU_WORK (default /tmp/mgpu); the device tool brings back at
# most 8 files from $OUT, so $OUT gets summary.txt, the distributed suite's summary and every JSON
# and log packed in one mgpu_logs.tgz.
#
# Wheels: the GPU host has torch, triton, pytest and pyyaml but no megatron-core: it is carried as a
# Python 3.12 wheel in MGPU_WHEEL_DIR (default .gpu4, git-ignored) and installed with --no-deps
# into a --target site dir put on PYTHONPATH. MGPU_MCORE_VERSION picks one (default: the newest
# in the folder); MGPU_SKIP_INSTALL=1 uses what is importable. Through the device tool:
#   run(command="bash scripts/multi_gpu_suite.sh", carry=[".gpu4"], kind="nvidia-h200-x2")
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

work=${MGPU_WORK:-/tmp/mgpu}
out=${OUT:-$work}
mkdir -p "$work" "$out"
budget=${MGPU_BUDGET_S:-570}
start=$SECONDS
summary=()
failed=0

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(gpu1 attn tests ppo ppo_cp)
for s in "${steps[@]}"; do
  case "$s" in gpu1|attn|tests|ppo|ppo_half|ppo_cp|tp|ppo_tp1|maxmb) ;;
    *) echo "multi_gpu_suite: unknown step '$s' (gpu1 attn tests ppo ppo_half ppo_cp tp ppo_tp1 maxmb)" >&2; exit 2 ;;
  esac
done

ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
ranks=${MGPU_NPROC:-$ngpu}
case "$ranks" in ''|*[!0-9]*) echo "multi_gpu_suite: MGPU_NPROC must be a positive integer, got '$ranks'" >&2; exit 2 ;; esac
if [ "$ranks" -lt 1 ]; then
  echo "multi_gpu_suite: no GPU visible" >&2
  exit 2
fi
cpus=$(nproc 2>/dev/null || echo 2)
threads=$((cpus / ranks))
[ "$threads" -ge 1 ] || threads=1
[ "$threads" -le 8 ] || threads=8
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}

# ---- (a) the carried megatron-core wheel
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
  site=/tmp/mgpu_site_$version
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheel" "${other_wheels[@]}" >"$work/install.log" 2>&1; then
    cat "$work/install.log" >&2
    echo "multi_gpu_suite: installing the wheels failed" >&2
    exit 2
  fi
fi
export PYTHONPATH="${site:+$site:}$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  echo "== host: $ranks ranks, $ngpu GPU(s), $cpus CPUs, OMP_NUM_THREADS=$OMP_NUM_THREADS"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  python3 -c "
import importlib
for name in ('torch', 'triton', 'megatron.core', 'pytest'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', '?'))
    except Exception as err:
        print(f'{name}: not importable ({type(err).__name__}: {err})')
"
} 2>&1 | tee "$work/host.txt"

# run_step NAME LIMIT LOG CMD...: CMD in its own session under `timeout`, output to LOG (and a tail to stdout).
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt 30 ]; then
    summary+=("$(printf '%-9s %-22s %6s  %s' "$name" "SKIPPED (budget)" "-" "$(basename "$log")")")
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
  grep -v -e "warnings.warn" -e "UserWarning" -e "^W[0-9]" "$log" | tail -n "${MGPU_TAIL:-30}"
  summary+=("$(printf '%-9s %-22s %5ss  %s' "$name" "$verdict" "$took" "$(basename "$log")")")
}

torchrun=(python3 -m torch.distributed.run --standalone)
half=$((ranks / 2))
for step in "${steps[@]}"; do
  case "$step" in
    gpu1)
      run_step gpu1 "${MGPU_TIMEOUT_GPU1:-120}" "$work/gpu_attention.log" \
        python3 -m pytest tests/gpu/test_gpu_attention.py -q -rs -p no:cacheprovider
      ;;
    attn)
      run_step attn "${MGPU_TIMEOUT_ATTN:-120}" "$work/bench_attention.log" \
        python3 scripts/bench_attention.py --out "$work"
      ;;
    tests)
      run_step tests "${MGPU_TIMEOUT_TESTS:-300}" "$work/tests.log" \
        env MCORE_PPO_TEST_DIST_BACKEND=nccl MCORE_PPO_TEST_BACKEND=triton MCORE_PPO_TEST_TIMEOUT="${MCORE_PPO_TEST_TIMEOUT:-150}" \
        python3 scripts/run_distributed_tests.py --nproc "$ranks" --out "$work/tests"
      [ -f "$work/tests/summary.json" ] && cp "$work/tests/summary.json" "$out/distributed_summary.json"
      ;;
    ppo)
      run_step ppo "${MGPU_TIMEOUT_PPO:-240}" "$work/bench_ppo_tp$ranks.log" \
        env PYTHONWARNINGS=ignore "${torchrun[@]}" --nproc_per_node "$ranks" scripts/bench_ppo.py --tp "$ranks" --out "$work" ${MGPU_PPO_ARGS:-}
      ;;
    ppo_half)
      if [ "$ranks" -lt 4 ]; then summary+=("$(printf '%-9s %-22s' ppo_half "SKIPPED (< 4 GPUs)")"); continue; fi
      run_step ppo_half "${MGPU_TIMEOUT_PPO:-240}" "$work/bench_ppo_tp${half}_dp2.log" \
        env PYTHONWARNINGS=ignore "${torchrun[@]}" --nproc_per_node "$ranks" scripts/bench_ppo.py --tp "$half" --out "$work" ${MGPU_PPO_ARGS:-}
      ;;
    ppo_cp)
      run_step ppo_cp "${MGPU_TIMEOUT_PPO_CP:-300}" "$work/bench_ppo_tp${half}_cp2.log" \
        env PYTHONWARNINGS=ignore "${torchrun[@]}" --nproc_per_node "$ranks" scripts/bench_ppo.py --tp "$half" --cp 2 \
        --long-context "${MGPU_LONG_CONTEXT:-16384,32768,65536}" --out "$work" ${MGPU_PPO_ARGS:-}
      ;;
    tp)
      for shape in ${MGPU_TP_SHAPES:-3584x152064 8192x128256}; do
        run_step "tp${ranks}_h${shape%x*}" "${MGPU_TIMEOUT_TP:-150}" "$work/bench_tp${ranks}_${shape}.log" \
          env PYTHONWARNINGS=ignore "${torchrun[@]}" --nproc_per_node "$ranks" scripts/bench_tp.py \
          --hidden "${shape%x*}" --vocab "${shape#*x}" --out "$work"
      done
      ;;
    ppo_tp1)
      run_step ppo_tp1 "${MGPU_TIMEOUT_PPO:-240}" "$work/bench_ppo_tp1.log" \
        env PYTHONWARNINGS=ignore CUDA_VISIBLE_DEVICES=0 "${torchrun[@]}" --nproc_per_node 1 scripts/bench_ppo.py --out "$work" ${MGPU_PPO_ARGS:-}
      ;;
    maxmb)
      run_step maxmb "${MGPU_TIMEOUT_MAXMB:-300}" "$work/bench_ppo_max_micro_batch.log" \
        env PYTHONWARNINGS=ignore CUDA_VISIBLE_DEVICES=0 "${torchrun[@]}" --nproc_per_node 1 scripts/bench_ppo.py --skip-timing \
        --max-micro-batch "${MGPU_MAX_MB:-16384,32768,65536,131072,262144}" --out "$work"
      ;;
  esac
done

{
  echo
  echo "== multi_gpu_suite summary: $ranks ranks, $((SECONDS - start))s of ${budget}s"
  printf '%s\n' "${summary[@]}"
} | tee "$work/summary.txt"
cp "$work/summary.txt" "$out/summary.txt" 2>/dev/null
if [ "$out" != "$work" ]; then
  tar czf "$out/mgpu_logs.tgz" -C "$work" . 2>/dev/null
fi
exit $failed
