#!/usr/bin/env bash
# The head's timings on one GPU, this tree (A) against an earlier commit (B), in one device call:
#
#   bash scripts/ab_timing.sh prepare REF      # here: commit REF's tree (no tests, docs) into .ab/REF
#                                              # (git-ignored; AB_DIR names another folder)
#   bash scripts/ab_timing.sh run REF [STEP ...]   # on the GPU host, through the device tool:
#   run(command="bash scripts/ab_timing.sh run d84d748", carry=[".ab"])
#
# Steps (default: both), each tree visited in B A A B order so neither gets the warmer GPU:
#   gpu    scripts/head_time.py: GPU time and idle-GPU time against one GEMM, forward, no-grad
#          forward and step, AB_SHARDS (default qwen7b at TP 1/4/8 and V 262,144 at TP 1/4/8);
#          AB_VALIDATE=1 runs both trees with the API's default validate=True
#   host   scripts/host_work.py --shape qwen7b --tp 8: host work of the forward, the no-grad
#          forward and the backward node, GPU kept busy; A's second visit adds --tp-combine
# Before them, always, the GPU's name and the versions (visit env).
#
# B runs its own mcore_ppo with this tree's head_time.py (the same measurement for both trees);
# host_work.py is each tree's own (its output keys are stable). Every visit runs under its own
# `timeout` (AB_STEP_S, default 150 s); the whole call stays under AB_BUDGET_S (default 570 s):
# a visit with < 30 s left is skipped. Logs and JSON go to $OUT (or /tmp/ab): one folder per
# visit is packed into ab_timing.tgz beside steps.tsv (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
action=${1:-}
ref=${2:-}
if [ -z "$action" ] || [ -z "$ref" ]; then
  echo "usage: bash scripts/ab_timing.sh prepare|run REF [STEP ...]" >&2
  exit 2
fi
shift 2
tree=${AB_DIR:-.ab}/$ref

if [ "$action" = prepare ]; then
  rm -rf "$tree" && mkdir -p "$tree" || exit 1
  # The whole tree but its tests and docs (an older tree kept packages beside mcore_ppo).
  mapfile -t paths < <(git ls-tree --name-only "$ref" | grep -v -x -e tests -e docs)
  git archive "$ref" "${paths[@]}" | tar -x -C "$tree" || exit 1
  cp scripts/head_time.py "$tree/scripts/head_time.py"
  echo "$tree: $(git rev-parse --short "$ref") (${paths[*]}; this tree's head_time.py)"
  exit 0
fi
if [ "$action" != run ]; then
  echo "ab_timing: unknown action $action (prepare or run)" >&2
  exit 2
fi
if [ ! -d "$tree/mcore_ppo" ]; then
  echo "ab_timing: $tree is missing: run 'bash scripts/ab_timing.sh prepare $ref' here and carry .ab" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/ab}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(gpu host)
for step in "${steps[@]}"; do
  case $step in
    gpu | host) ;;
    *)
      echo "ab_timing: unknown step $step (gpu, host)" >&2
      exit 2
      ;;
  esac
done
shards=${AB_SHARDS:-qwen7b:1,qwen7b:4,qwen7b:8,v262k:1,v262k:4,v262k:8}
validate=()
[ "${AB_VALIDATE:-0}" = 1 ] && validate=(--validate)
mkdir -p "$out/visits"
budget=${AB_BUDGET_S:-570}
step_s=${AB_STEP_S:-150}
start=$(date +%s)

# visit NAME DIR CMD...: CMD in DIR under a timeout cut to the budget left; log and row in steps.tsv.
visit() {
  local name=$1 dir=$2
  shift 2
  local left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt 30 ]; then
    printf '%s\tskipped\t0\n' "$name" >>"$out/steps.tsv"
    return
  fi
  local limit=$((left < step_s ? left : step_s)) t0
  t0=$(date +%s)
  mkdir -p "$out/visits/$name"
  (cd "$dir" && timeout -k 10 "$limit" "$@") >"$out/visits/$name/log.txt" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$out/steps.tsv"
  tail -n 8 "$out/visits/$name/log.txt"
  (cd "$out" && tar czf ab_timing.tgz visits)
}

visit env . bash -c "nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; python3 -c \
  'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)'"
for step in "${steps[@]}"; do
  case $step in
    gpu)
      for side in B A A B; do
        dir=.
        [ "$side" = B ] && dir=$tree
        n=$(find "$out/visits" -maxdepth 1 -name "gpu_${side}*" | wc -l)
        visit "gpu_${side}$((n + 1))" "$dir" python3 scripts/head_time.py --shards "$shards" "${validate[@]}" \
          --out "$out/visits/gpu_${side}$((n + 1))/head_time.json"
      done
      ;;
    host)
      for side in B A A B; do
        dir=.
        [ "$side" = B ] && dir=$tree
        n=$(find "$out/visits" -maxdepth 1 -name "host_${side}*" | wc -l)
        extra=()
        [ "$side$n" = A1 ] && extra=(--tp-combine)
        visit "host_${side}$((n + 1))" "$dir" python3 scripts/host_work.py --shape qwen7b --tp 8 "${extra[@]}" \
          --out "$out/visits/host_${side}$((n + 1))"
      done
      ;;
  esac
done
cat "$out/steps.tsv"
