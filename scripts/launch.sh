#!/usr/bin/env bash
# torchrun launcher of the PPO demo (scripts/ppo_step.py): the README's main command. Every
# option, size and the backend's name are checked here, before any rank starts (exit 2, one
# line); the run gets its own session (setsid) under `timeout`, so a hung collective cannot
# outlive the launcher: on timeout or Ctrl-C every rank is killed.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'USAGE'
usage: scripts/launch.sh [--tp N] [--cp N] [--pp N] [--nproc N] [--config FILE] [--timeout S]
                         [--sp | --no-sp] [--cp-mode model|head] [--steps N] [--backend B]

PPO steps of a small Megatron GPT with the fused head under torchrun, and their parity checks.
With no options: the layout of configs/ppo_demo.yaml (TP 2 with sequence parallelism, CP 2
inside the model), 4 ranks, gloo on the CPUs (NCCL on GPUs, one per rank; with fewer GPUs
than ranks, on the CPUs). The first line printed says the layout and where each part came from.

  --tp, --cp, --pp N    parallel sizes; given, they set the whole layout: the ones not given
                        are 1 (--tp 2 alone: TP 2 x CP 1 x PP 1). Default: the config's layout
  --nproc N             ranks, a multiple of tp*cp*pp (default: tp*cp*pp)
  --config FILE         the demo config (default: configs/ppo_demo.yaml)
  --timeout S           kill every rank after S seconds (default: $MCORE_PPO_LAUNCH_TIMEOUT or 900)
  --sp, --no-sp         sequence parallelism on / off (default: the config's)
  --cp-mode MODE        model: the decoder runs CP | head: CP at the head only (default: the config's)
  --steps N             PPO steps (default: the config's)
  --backend B           head backend: auto, torch or triton (default: the config's)

Exit status: 0 every parity check passed, 1 a check failed, 2 a bad option, size or config.
USAGE
}
die() { echo "launch.sh: $*" >&2; exit 2; }

config=configs/ppo_demo.yaml
tp="" cp="" pp="" nproc=""
limit=${MCORE_PPO_LAUNCH_TIMEOUT:-900}
overrides=()  # ppo_step.py's own options, checked below with the config
need() { [ $# -ge 2 ] || die "$1 needs a value"; }
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
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
    --sp|--no-sp) overrides+=("$1"); shift ;;
    --cp-mode|--steps|--backend) need "$@"; overrides+=("$1" "$2"); shift 2 ;;
    --cp-mode=*|--steps=*|--backend=*) overrides+=("$1"); shift ;;
    *) die "unknown option '$1' (scripts/launch.sh --help lists the options)" ;;
  esac
done
for pair in "--tp=$tp" "--cp=$cp" "--pp=$pp" "--nproc=$nproc" "--timeout=$limit"; do
  flag=${pair%%=*} v=${pair#*=}
  case "$v" in ''|*[!0-9]*) [ -z "$v" ] || die "$flag must be a positive integer, got '$v'" ;; esac
done
[ "$limit" -gt 0 ] || die "--timeout must be a positive integer, got '$limit'"
[ -z "$nproc" ] || [ "$nproc" -gt 0 ] || die "--nproc must be a positive integer, got '$nproc'"
[ -f "$config" ] || die "no config file $config"

# Megatron/TE-absence UserWarnings and torchrun's OMP notice are noise here.
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# The config, the sizes (against the model's shape too), ppo_step.py's options and --nproc are
# checked once here, by the demo's own loader; sizes not given on the command line come from the
# config. The same interpreter then counts the GPUs (scripts/launch_preflight.py: torch only for
# that, never for a refusal).
check=("$config")
[ -z "$nproc" ] || check=(--nproc "$nproc" "${check[@]}")
[ -z "$tp" ] || check+=(--tp "$tp")
[ -z "$cp" ] || check+=(--cp "$cp")
[ -z "$pp" ] || check+=(--pp "$pp")
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
if ! preflight=$(python scripts/launch_preflight.py "${check[@]}" ${overrides[@]+"${overrides[@]}"} 2>"$errors"); then
  message=$(grep -v '^\s*$' "$errors" | tail -n 1)
  die "${message#demo_config: }"
fi
read -r tp cp pp nproc gpus <<<"$preflight"
echo "${preflight#*$'\n'}"

# One GPU per rank on CUDA: with fewer visible GPUs than ranks, run on the CPUs (gloo) instead
# of failing on a missing device, and say so.
if [ "$gpus" -gt 0 ] && [ "$gpus" -lt "$nproc" ]; then
  echo "launch: $nproc ranks need $nproc GPUs, $gpus visible: running on the CPUs with gloo (CUDA_VISIBLE_DEVICES='')"
  export CUDA_VISIBLE_DEVICES=""
fi

echo "launch: torchrun --standalone --nproc_per_node $nproc scripts/ppo_step.py --config $config --tp $tp --cp $cp --pp $pp ${overrides[*]:-} (timeout ${limit}s)"
setsid --wait timeout --kill-after=20 "$limit" \
  torchrun --standalone --nproc_per_node "$nproc" scripts/ppo_step.py \
  --config "$config" --tp "$tp" --cp "$cp" --pp "$pp" ${overrides[@]+"${overrides[@]}"} &
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
