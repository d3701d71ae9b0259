#!/usr/bin/env bash
# One device call on the committed tree: the GPU tests of Σπ² and verl's top-k distillation, the
# Σπ² cost beside the plain forward (bench_head), and verl's forward_kl_topk step and longest
# sequence (bench_verl_distill). Every step under its own timeout and one overall deadline.
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/out}
RES=/tmp/res
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-230}
SITE=/tmp/site
STEPS=$RES/0_steps.tsv
printf 'step\trc\tseconds\tcommand\n' > "$STEPS"
pack() { tar -czf "$OUT/run36b.tgz" -C "$RES" . 2>/dev/null; cp "$STEPS" "$OUT/steps.tsv"; }
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped (${left}s left)" | tee "$RES/$name.log"
    printf '%s\tskipped\t0\t%s\n' "$name" "$*" >> "$STEPS"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== [$SECONDS s] $name (timeout ${limit}s): $*"
  local t0=$SECONDS
  (PYTHONPATH="$SITE:$ROOT" timeout -k 5 "$limit" "$@") > "$RES/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" >> "$STEPS"
  echo "   rc $rc, $((SECONDS - t0)) s; last line: $(tail -n 1 "$RES/$name.log" | cut -c1-200)"
  pack
}
{
  date -u; nvidia-smi; python3 --version; git -C "$ROOT" log --oneline -1 2>/dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl .carry/megatron_core-0.19.0*.whl \
    && echo "wheels installed"
  PYTHONPATH=$SITE python3 -c "
import importlib.metadata as md, torch
print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
for n in ('triton', 'megatron-core', 'verl', 'transformers', 'liger-kernel'):
    try: print(n, md.version(n))
    except Exception as e: print(n, 'missing', e)
"
} > "$RES/0_env.log" 2>&1
tail -n 7 "$RES/0_env.log"
pack
PT="python3 -m pytest -q -p no:cacheprovider -rfEs --durations=5"
step 1_verl_distill_step 90 python3 scripts/bench_verl_distill.py --mode step --tp 1,8 --k 128 --vocab 151936 \
  --tokens 8192 --hidden 3584 --out "$RES/1_step"
step 2_gpu_tests 100 $PT tests/gpu/test_gpu_verl_live.py tests/integrations/test_verl_distill.py tests/distill/test_student.py \
  -k "distill or log_normalizer"
echo "== done at $SECONDS s"
cat "$STEPS"
