#!/usr/bin/env bash
# torchrun launcher of the PPO demo (scripts/ppo_step.py). With no arguments it is the README's
# main command: TP 2 with sequence parallelism and CP 2 inside the model,
# 4 ranks, gloo on CPU (NCCL on GPUs, one per rank; with fewer GPUs than ranks, on the CPUs).
#
#   scripts/launch.sh [--tp N] [--cp N] [--pp N] [--nproc N] [--config FILE] [--timeout SECONDS]
#                     [any ppo_step.py option: --sp | --no-sp, --cp-mode model|head, --steps N, --backend B]
#
# --tp/--cp/--pp default to the config's layout (configs/ppo_demo.yaml); --nproc defaults to
# tp·cp·pp. The run gets its own session (setsid) under `timeout`, so a hung collective cannot
# outlive the launcher: on timeout or Ctrl-C every rank is killed.
set -euo pipefail
cd "$(dirname "$0")/.."

config=configs/ppo_demo.yaml
tp="" cp="" pp="" nproc=""
limit=${MCORE_PPO_LAUNCH_TIMEOUT:-900}
extra=()
need() { [ $# -ge 2 ] || { echo "launch.sh: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tp) need "$@"; tp=$2; shift 2 ;;
    --cp) need "$@"; cp=$2; shift 2 ;;
    --pp) need "$@"; pp=$2; shift 2 ;;
    --nproc) need "$@"; nproc=$2; shift 2 ;;
    --config) need "$@"; config=$2; shift 2 ;;
    --timeout) need "$@"; limit=$2; shift 2 ;;
    --tp=*) tp=${1#*=}; shift ;;
    --cp=*) cp=${1#*=}; shift ;;
    --pp=*) pp=${1#*=}; shift ;;
    --nproc=*) nproc=${1#*=}; shift ;;
    --config=*) config=${1#*=}; shift ;;
    --timeout=*) limit=${1#*=}; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) extra+=("$1"); shift ;;
  esac
done
for v in "$tp" "$cp" "$pp" "$nproc" "$limit"; do
  case "$v" in ''|*[!0-9]*) [ -z "$v" ] || { echo "launch.sh: sizes must be positive integers, got '$v'" >&2; exit 2; } ;; esac
done
[ -f "$config" ] || { echo "launch.sh: no config file $config" >&2; exit 2; }

# The config and the sizes are checked once here, by the demo's own loader (a bad key, type or
# size exits 2 before any rank starts); sizes not given on the command line come from the config.
check=("$config" --layout)
[ -z "$tp" ] || check+=(--tp "$tp")
[ -z "$cp" ] || check+=(--cp "$cp")
[ -z "$pp" ] || check+=(--pp "$pp")
sizes=$(python -m mcore_ppo_testing.demo_config "${check[@]}") || {
  echo "launch.sh: invalid config or sizes ($config)" >&2
  exit 2
}
read -r tp cp pp <<<"$sizes"
nproc=${nproc:-$((tp * cp * pp))}
if [ $((nproc % (tp * cp * pp))) -ne 0 ]; then
  echo "launch.sh: --nproc $nproc is not a multiple of tp*cp*pp = $((tp * cp * pp))" >&2
  exit 2
fi

# One GPU per rank on CUDA: with fewer visible GPUs than ranks, run on the CPUs (gloo) instead
# of failing on a missing device, and say so.
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$gpus" -gt 0 ] && [ "$gpus" -lt "$nproc" ]; then
  echo "launch: $nproc ranks need $nproc GPUs, $gpus visible: running on the CPUs with gloo (CUDA_VISIBLE_DEVICES='')"
  export CUDA_VISIBLE_DEVICES=""
fi

# Megatron/TE-absence UserWarnings and torchrun's OMP notice are noise here.
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "launch: torchrun --standalone --nproc_per_node $nproc scripts/ppo_step.py --config $config --tp $tp --cp $cp --pp $pp ${extra[*]:-} (timeout ${limit}s)"
setsid --wait timeout --kill-after=20 "$limit" \
  torchrun --standalone --nproc_per_node "$nproc" scripts/ppo_step.py \
  --config "$config" --tp "$tp" --cp "$cp" --pp "$pp" ${extra[@]+"${extra[@]}"} &
pid=$!
# setsid made $pid the leader of a new process group: signal the whole group on the way out.
trap 'kill -TERM -- "-$pid" 2>/dev/null || true' INT TERM
status=0
wait "$pid" || status=$?
trap - INT TERM
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "launch.sh: the run exceeded ${limit}s and was killed" >&2
fi
exit "$status"
