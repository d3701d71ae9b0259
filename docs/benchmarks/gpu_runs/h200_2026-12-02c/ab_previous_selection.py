"""bench_distill with its 'torch' slot running the previous selection (c87af4e: torch.topk + rest_fold_kernel); the
JSON/markdown rows named 'torch' are that kernel (renamed when recorded)."""
import sys
from pathlib import Path
root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / ".probe" / "prev_topk"), str(root / "scripts"), str(root)]
import bench_distill as bench
import distill_topk as old

new = bench.fused_topk
def fused(x, w, k, *, temperature, impl):
    if impl == "torch":
        return old.fused_topk(x, w, k, temperature=temperature, impl="triton")
    return new(x, w, k, temperature=temperature, impl=impl)
bench.fused_topk = fused
sys.exit(bench.main())
