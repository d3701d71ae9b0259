"""``scripts/bench_distill.py`` with one of its slots running the previous teacher kernel.

The previous kernel's two files (``mcore_ppo/distill/topk.py`` and ``mcore_ppo/kernels/topk.py``
of commit 65d8b7e) sit in ``.probe/old_topk/`` as ``distill_topk.py`` and ``kernels_topk.py``
(the first importing the second). Calls 1, 2 and 4 ran the variant that replaced the ``naive``
slot; call 5 ran this one, which replaces the ``torch`` slot (the recorded JSON and markdown name
it ``previous_kernel``).
"""

import importlib
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(root / ".probe" / "old_topk"), str(root / "scripts"), str(root)]
bench = importlib.import_module("bench_distill")
old = importlib.import_module("distill_topk")
new = bench.fused_topk


def fused(x, w, k, *, temperature, impl):
    if impl == "torch":
        return old.fused_topk(x, w, k, temperature=temperature, impl="triton")
    return new(x, w, k, temperature=temperature, impl=impl)


bench.fused_topk = fused
sys.exit(bench.main())
