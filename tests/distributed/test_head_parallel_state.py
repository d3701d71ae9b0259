"""``tp_group=None`` resolves to Megatron's ``parallel_state`` when it is initialised.

Megatron's model parallelism is initialised on the whole world (4 gloo ranks: TP 4, TP 2 × CP 2;
8 ranks: TP 8, TP 4 × CP 2; 2 ranks: TP 2), and
the head called with ``tp_group=None`` must give bitwise the same outputs and gradients as with
the explicit group of the same ranks, and match the single-rank result computed before the
initialisation. ``destroy_model_parallel`` runs in a ``finally`` so no later test inherits it.
"""

import pytest
import torch
import torch.distributed as dist
from conftest import layout_id, megatron_timeout_minutes, shared_seed, tp_cp_groups
from head_cases import DTYPES, LAYOUT_SHAPES, compare, make_case, reference, run_head, tp_part
from megatron.core import parallel_state

from mcore_ppo.parallel import resolve_cp_group, resolve_tp_group

pytestmark = pytest.mark.usefixtures("fresh_parallel_state")


# A world of 4 runs the first three, a world of 8 the last two (and 2: tp2).
MEGATRON_LAYOUTS = [(2, 1), (4, 1), (2, 2), (8, 1), (4, 2)]


@pytest.mark.parametrize(("tp", "cp"), MEGATRON_LAYOUTS, ids=[layout_id(*layout) for layout in MEGATRON_LAYOUTS])
def test_tp_group_none_resolves_to_megatron(tp, cp, check):
    if dist.get_world_size() != tp * cp:
        # Megatron's groups tile the whole world; the harness's cover its first tp·cp ranks only.
        pytest.skip(f"compares with Megatron's groups over the whole world: needs a world of {tp * cp} ranks")
    layout = tp_cp_groups(tp, cp)
    torch.manual_seed(shared_seed())
    # References first: once Megatron is initialised, tp_group=None is no longer one rank.
    cases = [make_case(name, dtype) for dtype in DTYPES for name in LAYOUT_SHAPES]
    refs = [reference(case) for case in cases]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        distributed_timeout_minutes=megatron_timeout_minutes(),
    )
    try:
        megatron_tp = parallel_state.get_tensor_model_parallel_group()
        megatron_cp = parallel_state.get_context_parallel_group()
        if resolve_tp_group(None) is not megatron_tp or resolve_cp_group(None) is not megatron_cp:
            check.fail("resolve_tp_group/resolve_cp_group(None) did not return Megatron's groups")
        if dist.get_process_group_ranks(megatron_tp) != dist.get_process_group_ranks(layout.tp_group):
            check.fail("Megatron's TP group and the harness's differ: the comparison below would be meaningless")
        if dist.get_process_group_ranks(megatron_cp) != dist.get_process_group_ranks(layout.cp_group):
            check.fail("Megatron's CP group and the harness's differ")
        weight_rank = parallel_state.get_tensor_model_parallel_rank()
        for case, ref in zip(cases, refs, strict=True):
            dtype = case.hidden.dtype
            weight = case.weight.chunk(tp, dim=0)[weight_rank]
            for sp in (False, True):
                check.case(f"megatron tp={tp} cp={cp} sp={sp} layout={case.layout} {dtype}")
                hidden = case.hidden.chunk(tp, dim=0)[weight_rank] if sp else case.hidden
                args = (hidden, weight, case.labels, case.grad_log_prob, case.grad_entropy)
                implicit = run_head(*args, tp_group=None, sequence_parallel=sp)
                explicit = run_head(*args, tp_group=layout.tp_group, sequence_parallel=sp)
                for output, value in implicit.as_dict().items():
                    check.equal(f"{output} (tp_group=None vs explicit)", value, explicit.as_dict()[output])
                compare(check, implicit, tp_part(ref, tp, weight_rank, sp), dtype, f"Megatron TP{tp} CP{cp}")
    finally:
        parallel_state.destroy_model_parallel()
    if resolve_tp_group(None) is not None:
        check.fail("after destroy_model_parallel, tp_group=None must resolve to one rank again")
    check.done()
