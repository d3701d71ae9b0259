"""Pure Triton kernels of the head (no torch-level logic: the host wrappers live in
:mod:`mcore_ppo.backends.triton_backend`).

- :mod:`.forward`: the fused GEMM + online-softmax statistics kernel and the per-token merge
  of its per-split partial statistics; over TP, the shard's max, the merge to the group's max
  and the outputs from the summed statistics, around the combine's two all-reduces.
- :mod:`.backward`: the fused GEMM whose epilogue writes ``dz / T`` for one vocab chunk.
- :mod:`.compact`: valid rows first, and their count, on the device in one launch; rows
  gathered into that order (ignored ones zeroed) and scattered back; the forward's per-token
  preparation from the global labels (``tokens_kernel``).
- :mod:`.split`: fp32 operands as fp16 parts along K, the GEMM operands of the fp32-faithful
  precision.
"""

from mcore_ppo.kernels.backward import dz_from_buffer_kernel, dz_kernel
from mcore_ppo.kernels.compact import compact_kernel, gather_rows_kernel, scatter_rows_kernel, tokens_kernel
from mcore_ppo.kernels.forward import (
    finish_kernel,
    merge_finish_kernel,
    merge_splits_kernel,
    merge_to_max_kernel,
    split_max_kernel,
    stats_kernel,
)
from mcore_ppo.kernels.split import split_kernel

__all__ = [
    "compact_kernel",
    "dz_from_buffer_kernel",
    "dz_kernel",
    "finish_kernel",
    "gather_rows_kernel",
    "merge_finish_kernel",
    "merge_splits_kernel",
    "merge_to_max_kernel",
    "scatter_rows_kernel",
    "split_kernel",
    "split_max_kernel",
    "stats_kernel",
    "tokens_kernel",
]
