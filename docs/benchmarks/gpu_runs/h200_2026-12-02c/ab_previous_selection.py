"""``scripts/bench_distill.py`` with its ``torch`` slot running the previous selection.

The previous selection's two files (``mcore_ppo/distill/topk.py`` and ``mcore_ppo/kernels/topk.py``
of commit c87af4e: ``torch.topk`` over the candidates, a tie repair, ``rest_fold_kernel``) sit in
``.probe/prev_topk/`` as ``distill_topk.py`` and ``kernels_topk.py`` (the first importing the
second: ``sed 's/from mcore_ppo.kernels.topk import/from kernels_topk import/'``). The recorded
JSON and markdown rows named ``torch`` are that selection; ``triton`` is the tree's.
"""

import importlib
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(root / ".probe" / "prev_topk"), str(root / "scripts"), str(root)]
bench = importlib.import_module("bench_distill")
old = importlib.import_module("distill_topk")
new = bench.fused_topk


def fused(x, w, k, *, temperature, impl):
    if impl == "torch":
        return old.fused_topk(x, w, k, temperature=temperature, impl="triton")
    return new(x, w, k, temperature=temperature, impl=impl)


bench.fused_topk = fused
sys.exit(bench.main())
