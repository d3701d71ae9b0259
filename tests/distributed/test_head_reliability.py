"""The single-rank reliability cases under TP 2 and 4 (SP off and on), every layout: what a single rank guarantees holds
across ranks too.

- Labels narrower than int64 (int16 with -100, uint8 with 255 as the ignore index) give what
  int64 labels give, bit for bit: the ignore index and every shard's vocab range are compared
  in int64 (a uint8 comparison would wrap -100 to 156).
- Inside an autocast region (bf16 for the suite's device) fp32 inputs give what they give
  outside (bitwise on CPU; on GPUs to 1e-6, as cuBLAS may pick another algorithm).
- ``create_graph=True`` through the head raises NotImplementedError on every rank, before any
  collective of the backward (so no rank waits for another), and the ranks stay in step: a good
  call after it still matches the single-rank result.
"""

import pytest
import torch
from conftest import shared_seed, tp_cp_groups
from head_cases import DEVICE, LAYOUT_SHAPES, TP_SIZES, compare, make_case, reference, run_head, tp_part

from mcore_ppo import fused_log_probs_and_entropy

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")


@pytest.mark.parametrize("tp", TP_SIZES)
def test_label_dtypes_autocast_and_double_backward(tp, check):
    layout = tp_cp_groups(tp)
    torch.manual_seed(shared_seed())
    if layout.tp_group is None:  # a rank outside this layout
        check.done()
        return
    rank = layout.tp_rank
    for name in LAYOUT_SHAPES:
        case = make_case(name, torch.float32)
        ref = reference(case)
        weight = case.weight.chunk(tp, dim=0)[rank]
        for sp in (False, True):
            hidden = case.hidden.chunk(tp, dim=0)[rank] if sp else case.hidden
            args = (hidden, weight, case.labels, case.grad_log_prob, case.grad_entropy)
            base = run_head(*args, tp_group=layout.tp_group, sequence_parallel=sp)
            check.case(f"tp={tp} sp={sp} layout={name} int64 labels")
            compare(check, base, tp_part(ref, tp, rank, sp), torch.float32, f"TP{tp} reliability")

            for dtype, ignore in ((torch.int16, -100), (torch.uint8, 255)):
                check.case(f"tp={tp} sp={sp} layout={name} {dtype} labels, ignore_index={ignore}")
                labels = torch.where(case.labels == -100, ignore, case.labels).to(dtype)
                narrow = run_head(
                    hidden,
                    weight,
                    labels,
                    *args[3:],
                    tp_group=layout.tp_group,
                    sequence_parallel=sp,
                    ignore_index=ignore,
                )
                for output, value in narrow.as_dict().items():
                    check.equal(output, value, base.as_dict()[output])

            check.case(f"tp={tp} sp={sp} layout={name} inside autocast")
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                inside = run_head(*args, tp_group=layout.tp_group, sequence_parallel=sp)
            for output, value in inside.as_dict().items():
                if DEVICE.type == "cpu":
                    check.equal(output, value, base.as_dict()[output])
                else:
                    check.close(output, value, base.as_dict()[output], tol=1e-6, kind=f"TP{tp} autocast vs not")

            check.case(f"tp={tp} sp={sp} layout={name} create_graph refused")
            x = hidden.detach().clone().to(DEVICE).requires_grad_(True)
            log_prob, _ = fused_log_probs_and_entropy(
                x, weight.to(DEVICE), case.labels.to(DEVICE), tp_group=layout.tp_group, sequence_parallel=sp
            )
            check.raises(
                NotImplementedError, "differentiable once", torch.autograd.grad, log_prob.sum(), x, create_graph=True
            )
            check.case(f"tp={tp} sp={sp} layout={name} good call after the refusal")
            again = run_head(*args, tp_group=layout.tp_group, sequence_parallel=sp)
            compare(check, again, tp_part(ref, tp, rank, sp), torch.float32, f"TP{tp} reliability")
    check.done()
