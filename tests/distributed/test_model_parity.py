"""The fused head inside a Megatron GPTModel equals the model's own logits path, in every TP layout.

For a small GPT (2 layers, h 32, 8 heads, vocab 128, 16 tokens, float64) and each of TP 1/2/4/8
(TP 8 where the world has 8 ranks), SP on/off, tied/untied embeddings, padded and packed (THD) batches:

- the head's ``(log_probs, entropy)`` equal those from the model's full logits (gathered over
  TP, float64 log-softmax), through the ``output_processor`` hook path and the fallback path;
- so do the gradients of EVERY parameter after one backward of random per-token weights
  (compared per rank, i.e. per shard);
- every TP layout equals TP 1 (the same global weights from the CPU init; shard gradients
  gathered along their partition dim, SP-partial gradients summed over TP).

CP (CP 2, TP 2 × CP 2; on 8 ranks also TP 4 × CP 2 and TP 2 × CP 4, with SP): at the output
boundary (final hidden states of a cp=1 run, split as Megatron splits them, through the installed
head), and inside the whole model (the harness's CP attention, ``SdpaAttention``: K/V
all-gathered over CP, Megatron's load-balanced chunks) against the cp=1 model.

Σπ² (``gpt_log_probs_and_entropy(..., return_sum_pi_squared=True)``) through the model path,
TP 2 with SP and TP 2 × CP 2 with SP, both forward paths, per-token temperature, entropy off:
equal to the TP 1 model's and to fp64 from the layout's own full logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import DEVICE, fitting, model_parallel, require_ranks, shared_seed
from megatron.core import parallel_state

from mcore_ppo import gpt_log_probs_and_entropy, install_fused_head
from mcore_ppo.parallel.context_parallel import (
    roll_and_split_labels,
    roll_labels,
    split_for_cp,
    split_temperature_for_cp,
)
from mcore_ppo_testing.gpt_builder import build_gpt_model
from mcore_ppo_testing.gpt_reference import (
    logits_log_probs_and_entropy,
    pop_parameter_grads,
    synthetic_batch,
    weighted_backward,
)
from mcore_ppo_testing.hooked_gpt import forward_path
from mcore_ppo_testing.layer_specs import local_gpt_spec

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 128, 32, 8, 2, 16
TEMPERATURE = 0.7
# float64 model and reference: any real bug is many orders of magnitude above these.
TOL = {"rtol": 1e-9, "atol": 1e-11}
LAYOUTS = [(1, False), (2, False), (2, True), (4, False), (4, True), (8, False), (8, True)]

MAX_DIFF: dict[str, float] = {}


def _record(key: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    MAX_DIFF[key] = max(MAX_DIFF.get(key, 0.0), diff)


def _close(key: str, actual: torch.Tensor, expected: torch.Tensor, where: str = "") -> None:
    _record(key, actual, expected)
    torch.testing.assert_close(actual.double(), expected.double(), **TOL, msg=lambda m: f"{key} {where}: {m}")


@pytest.fixture(scope="module", autouse=True)
def shims(gpt_cpu_shims):
    """CPU shims for GPTModel (never on a CUDA machine, where Megatron runs unmodified)."""
    yield
    if dist.get_rank() == 0 and MAX_DIFF:
        print("\nmodel parity max |diff|: " + ", ".join(f"{k}={v:.2e}" for k, v in sorted(MAX_DIFF.items())))


def _model(*, tied: bool, sp: bool, attention: str = "reference", **overrides):
    return build_gpt_model(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        tie_embeddings=tied,
        sequence_parallel=sp,
        params_dtype=torch.float64,
        seed=4321,
        transformer_layer_spec=local_gpt_spec(attention=attention),
        device=DEVICE,
        **overrides,
    )


def _full_grads(model, grads: dict[str, torch.Tensor], sp: bool) -> dict[str, torch.Tensor]:
    """Per-rank gradients as TP 1 would hold them: shards gathered, SP partials summed.

    One all-gather and one all-reduce for the whole model (not one per parameter): on a busy
    machine every collective costs a scheduling round trip between the ranks.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    world = parallel_state.get_tensor_model_parallel_world_size()
    if world == 1:
        return dict(grads)
    params = dict(model.named_parameters())
    sharded = [n for n in grads if getattr(params[n], "tensor_model_parallel", False)]
    partial = [n for n in grads if n not in sharded and sp and getattr(params[n], "sequence_parallel", False)]
    full = {n: g for n, g in _summed(grads, partial, group).items() if n not in sharded}
    if sharded:
        flat = torch.cat([grads[n].reshape(-1) for n in sharded])
        parts = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(parts, flat, group=group)
        pieces = [part.split([grads[n].numel() for n in sharded]) for part in parts]
        for i, name in enumerate(sharded):
            shards = [p[i].view_as(grads[name]) for p in pieces]
            full[name] = torch.cat(shards, dim=params[name].partition_dim)
    return full


def _layout_name(tp: int, sp: bool) -> str:
    return f"tp{tp}{'sp' if sp else ''}"


CASES = [(kind, tied) for kind in ("padded", "packed") for tied in (False, True)]


def test_head_matches_logits_path_every_layout():
    """All 20 cases (5 TP/SP layouts × padded/packed × untied/tied) in one test, so each layout's
    process groups are created once (group creation dominates on a busy 2-core machine)."""
    torch.manual_seed(shared_seed())
    data = {}
    for kind, tied in CASES:
        batch = synthetic_batch(kind, vocab_size=VOCAB, seq_length=SEQ, device=DEVICE)
        g_lp = torch.randn(batch.labels.shape, dtype=torch.float64).to(DEVICE)
        g_ent = torch.randn(batch.labels.shape, dtype=torch.float64).to(DEVICE)
        data[kind, tied] = (batch, g_lp, g_ent)

    tp1 = {}
    for tp, sp in fitting(LAYOUTS, lambda layout: layout[0], lambda layout: _layout_name(*layout)):
        with model_parallel(tp):
            for kind, tied in CASES:
                where = f"{_layout_name(tp, sp)} {kind} {'tied' if tied else 'untied'}"
                batch, g_lp, g_ent = data[kind, tied]
                inputs = batch.model_inputs()
                model = _model(tied=tied, sp=sp)
                ref_lp, ref_ent = logits_log_probs_and_entropy(
                    model, labels=batch.labels, temperature=TEMPERATURE, **inputs
                )
                weighted_backward(ref_lp, ref_ent, g_lp, g_ent)
                ref_grads = pop_parameter_grads(model)

                head = install_fused_head(model, temperature=TEMPERATURE, backend="torch")
                assert head is model.output_layer
                results = {}
                for path in ("fallback", "hook"):
                    with forward_path(model, path):
                        lp, ent = gpt_log_probs_and_entropy(model, labels=batch.labels, **inputs)
                    assert lp.shape == batch.labels.shape == ent.shape, where
                    _close(f"logp[{path}]", lp, ref_lp, where)
                    _close(f"entropy[{path}]", ent, ref_ent, where)
                    weighted_backward(lp, ent, g_lp, g_ent)
                    grads = pop_parameter_grads(model)
                    assert grads.keys() == ref_grads.keys(), where
                    for name in grads:
                        _close(f"grad[{path}]", grads[name], ref_grads[name], f"{where} {name}")
                    results[path] = (lp.detach(), ent.detach(), grads)

                lp, ent, grads = results["fallback"]
                full = _full_grads(model, grads, sp)
                if tp == 1:
                    tp1[kind, tied] = (lp, ent, full)
                else:
                    # Same global weights in every TP layout, so the same numbers as TP 1.
                    ref = tp1[kind, tied]
                    _close("logp[tp vs tp1]", lp, ref[0], where)
                    _close("entropy[tp vs tp1]", ent, ref[1], where)
                    assert full.keys() == ref[2].keys(), where
                    for name in full:
                        _close("grad[tp vs tp1]", full[name], ref[2][name], f"{where} {name}")
    dist.barrier()


CP_LAYOUTS = [(1, 2, False), (2, 2, False), (2, 2, True), (4, 2, True), (2, 4, True)]


def _cp_batch(kind: str, cp: int):
    """A batch CP ``cp`` can split: packed sequences of 2·cp, 4·cp and 2·cp tokens (CP 2: the
    default 4, 8, 4); padded rows of SEQ = 16 tokens divide by 2·cp up to CP 4."""
    return synthetic_batch(kind, vocab_size=VOCAB, seq_length=SEQ, seq_lengths=(2 * cp, 4 * cp, 2 * cp), device=DEVICE)


def _check_cp_boundary(kind: str, tp: int, cp: int, sp: bool) -> None:
    where = f"tp{tp} cp{cp}{' sp' if sp else ''} {kind}"
    batch = _cp_batch(kind, cp)
    cu = batch.cu_seqlens
    labels_full = roll_labels(batch.input_ids, seq_dim=1, cu_seqlens=cu)
    g_lp = torch.randn(labels_full.shape, dtype=torch.float64).to(DEVICE)
    g_ent = torch.randn(labels_full.shape, dtype=torch.float64).to(DEVICE)

    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    # The local attention cannot run CP > 1, so the model itself is CP-unaware
    # (config context_parallel_size=1): on every CP rank it is the cp=1 run.
    model = _model(tied=False, sp=sp, context_parallel_size=1)
    head = install_fused_head(model, temperature=TEMPERATURE, backend="torch")

    model.post_process = False
    try:
        with torch.no_grad():
            hidden = model(**batch.model_inputs())
    finally:
        model.post_process = True
    if sp:
        parts = [torch.empty_like(hidden) for _ in range(tp)]
        dist.all_gather(parts, hidden.contiguous(), group=tp_group)
        hidden = torch.cat(parts, dim=0)
    hidden = hidden.detach()  # [s, b, h] (padded) or [t, 1, h] (packed)

    # cp=1 reference: the same head on the whole sequence in this TP layout.
    ref_in = (hidden.chunk(tp, dim=0)[tp_rank] if sp else hidden).clone().requires_grad_()
    ref_lp, ref_ent = head(ref_in, labels_full)
    weighted_backward(ref_lp, ref_ent, g_lp, g_ent)
    ref_dw = head.weight.grad.clone()
    head.weight.grad = None
    ref_dhidden = torch.zeros_like(hidden)
    if sp:
        ref_dhidden.chunk(tp, dim=0)[tp_rank].copy_(ref_in.grad)
        dist.all_reduce(ref_dhidden, group=tp_group)
    else:
        ref_dhidden.copy_(ref_in.grad)

    # and float64 math on the whole sequence and vocab, to anchor the cp=1 run itself.
    weights = [torch.empty_like(head.weight) for _ in range(tp)]
    dist.all_gather(weights, head.weight.detach().contiguous(), group=tp_group)
    z = torch.einsum("sbh,vh->bsv", hidden, torch.cat(weights)) / TEMPERATURE
    log_softmax = torch.log_softmax(z, dim=-1)
    math_lp = log_softmax.gather(-1, labels_full.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    math_lp = torch.where(labels_full == -100, 0.0, math_lp)
    _close("cp: cp1 head vs fp64 math", ref_lp, math_lp, where)

    # CP: Megatron splits the sequence for CP first, then scatters it over TP for SP.
    local = split_for_cp(hidden, cp, cp_rank, seq_dim=0, cu_seqlens=cu)
    if sp:
        local = local.chunk(tp, dim=0)[tp_rank]
    local = local.clone().requires_grad_()
    assert local.shape[0] == hidden.shape[0] // (cp * (tp if sp else 1)), where
    labels = roll_and_split_labels(batch.input_ids, cp, cp_rank, seq_dim=1, cu_seqlens=cu)
    torch.testing.assert_close(labels, split_for_cp(labels_full, cp, cp_rank, seq_dim=1, cu_seqlens=cu))
    lp, ent = head(local, labels)

    def split(t, seq_dim):
        return split_for_cp(t, cp, cp_rank, seq_dim=seq_dim, cu_seqlens=cu)

    _close("cp: logp", lp, split(ref_lp.detach(), 1), where)
    _close("cp: entropy", ent, split(ref_ent.detach(), 1), where)
    weighted_backward(lp, ent, split(g_lp, 1), split(g_ent, 1))
    expected_dhidden = split(ref_dhidden, 0)
    if sp:
        expected_dhidden = expected_dhidden.chunk(tp, dim=0)[tp_rank]
    _close("cp: d_hidden", local.grad, expected_dhidden, where)
    # Each CP rank holds its tokens' part of d_W; DDP sums them over DP×CP.
    dw = head.weight.grad.clone()
    dist.all_reduce(dw, group=cp_group)
    _close("cp: d_weight", dw, ref_dw, where)


@pytest.mark.parametrize("tp,cp,sp", CP_LAYOUTS, ids=[f"tp{t}cp{c}{'sp' if s else ''}" for t, c, s in CP_LAYOUTS])
def test_cp_at_output_boundary(tp: int, cp: int, sp: bool):
    """Final hidden states of a cp=1 run, split as Megatron splits them, through the installed head
    under CP: values and gradients (hidden, head weight) equal the cp=1 ones (padded and packed)."""
    require_ranks(tp * cp, f"TP{tp} × CP{cp}")
    torch.manual_seed(shared_seed())
    with model_parallel(tp, cp):
        for kind in ("padded", "packed"):
            _check_cp_boundary(kind, tp, cp, sp)
    dist.barrier()


FULL_CP_LAYOUTS = [(1, 2, False), (2, 2, False), (2, 2, True), (4, 2, True), (2, 4, True)]


def _summed(grads: dict[str, torch.Tensor], names: list[str], group) -> dict[str, torch.Tensor]:
    """``grads`` with those in ``names`` summed over ``group`` (one flat all-reduce)."""
    out = dict(grads)
    if names:
        flat = torch.cat([grads[n].reshape(-1) for n in names])
        dist.all_reduce(flat, group=group)
        for n, piece in zip(names, flat.split([grads[n].numel() for n in names]), strict=True):
            out[n] = piece.view_as(grads[n])
    return out


def _comparable_across_cp(model, grads: dict[str, torch.Tensor], sp: bool) -> dict[str, torch.Tensor]:
    """Gradients as a cp=1 run holds them on this TP rank: summed over CP (each CP rank holds its
    tokens' part, which DDP sums over DP×CP), and SP-partial parameters summed over TP (their
    partials cover different tokens under different CP sizes)."""
    params = dict(model.named_parameters())
    grads = _summed(grads, sorted(grads), parallel_state.get_context_parallel_group())
    partial = [n for n in sorted(grads) if sp and getattr(params[n], "sequence_parallel", False)]
    return _summed(grads, partial, parallel_state.get_tensor_model_parallel_group())


def _full_model_run(tp: int, cp: int, sp: bool, attention: str, batch, g_lp, g_ent):
    """One forward/backward of the whole GPT with the fused head on this rank's CP part.

    Returns the logits of a labels=None forward ([b, s_local, V/tp]; packed [1, t_local, V/tp]),
    the log-probs, the entropy, and the gradients made comparable across CP sizes."""
    cu = batch.cu_seqlens
    rank = parallel_state.get_context_parallel_rank()

    def split(t: torch.Tensor) -> torch.Tensor:
        return split_for_cp(t, cp, rank, seq_dim=1, cu_seqlens=cu)

    model = _model(tied=False, sp=sp, attention=attention, context_parallel_size=cp)
    install_fused_head(model, temperature=TEMPERATURE, backend="torch")
    inputs = dict(batch.model_inputs(), input_ids=split(batch.input_ids), position_ids=split(batch.position_ids))
    labels = roll_and_split_labels(batch.input_ids, cp, rank, seq_dim=1, cu_seqlens=cu)
    with torch.no_grad():
        logits = model(**inputs)
    lp, ent = gpt_log_probs_and_entropy(model, labels=labels, **inputs)
    weighted_backward(lp, ent, split(g_lp), split(g_ent))
    grads = pop_parameter_grads(model)
    return logits, lp.detach(), ent.detach(), _comparable_across_cp(model, grads, sp)


@pytest.mark.parametrize("tp,cp,sp", FULL_CP_LAYOUTS, ids=[f"tp{t}cp{c}{'sp' * s}" for t, c, s in FULL_CP_LAYOUTS])
def test_full_model_context_parallel(tp: int, cp: int, sp: bool, check):
    """GPTModel with CP inside the model (SdpaAttention: K/V all-gathered over CP, Megatron's
    load-balanced chunks) equals the cp=1 model with the reference attention, padded and packed:
    logits, log-probs, entropy, and every parameter gradient (summed over CP as DDP does)."""
    require_ranks(tp * cp, f"TP{tp} × CP{cp}")
    torch.manual_seed(shared_seed())
    for kind in ("padded", "packed"):
        batch = _cp_batch(kind, cp)
        labels_full = roll_labels(batch.input_ids, seq_dim=1, cu_seqlens=batch.cu_seqlens)
        g_lp = torch.randn(labels_full.shape, dtype=torch.float64).to(DEVICE)
        g_ent = torch.randn(labels_full.shape, dtype=torch.float64).to(DEVICE)
        with model_parallel(tp, 1):
            ref = _full_model_run(tp, 1, sp, "reference", batch, g_lp, g_ent)
        with model_parallel(tp, cp):
            rank = parallel_state.get_context_parallel_rank()
            out = _full_model_run(tp, cp, sp, "sdpa", batch, g_lp, g_ent)
        check.case(f"tp{tp} cp{cp}{' sp' if sp else ''} {kind}")
        kind_name = f"model CP{cp} vs CP1 ({kind})"
        for output, actual, expected in zip(("logits", "log_prob", "entropy"), out[:3], ref[:3], strict=True):
            expected = split_for_cp(expected, cp, rank, seq_dim=1, cu_seqlens=batch.cu_seqlens)
            check.close(output, actual, expected, tol=1e-10, kind=kind_name)
        if out[3].keys() != ref[3].keys():
            check.fail(f"parameter names differ: {sorted(out[3].keys() ^ ref[3].keys())}")
        for name in sorted(out[3].keys() & ref[3].keys()):
            check.close(f"grad {name}", out[3][name], ref[3][name], tol=1e-9, kind=kind_name)
    check.done()


def _sum_pi_squared_run(tp: int, cp: int, batch, temperature: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Σπ² of the whole GPT (SP when TP > 1; CP inside the model with ``SdpaAttention``) through
    ``gpt_log_probs_and_entropy`` on both forward paths, this rank's CP part, and fp64
    ``Σ softmax(z / T)²`` from the same model's logits gathered over TP."""
    cu = batch.cu_seqlens
    rank = parallel_state.get_context_parallel_rank()

    def split(t: torch.Tensor) -> torch.Tensor:
        return split_for_cp(t, cp, rank, seq_dim=1, cu_seqlens=cu)

    model = _model(tied=False, sp=tp > 1, attention="sdpa" if cp > 1 else "reference", context_parallel_size=cp)
    install_fused_head(model, temperature=TEMPERATURE, backend="torch")  # Σπ² off: turned on per call
    inputs = dict(batch.model_inputs(), input_ids=split(batch.input_ids), position_ids=split(batch.position_ids))
    labels = roll_and_split_labels(batch.input_ids, cp, rank, seq_dim=1, cu_seqlens=cu)
    local_temperature = split_temperature_for_cp(temperature, cp, rank, seq_dim=1, cu_seqlens=cu)
    out = {}
    with torch.no_grad():
        for path in ("fallback", "hook"):
            with forward_path(model, path):
                lp, ent, out[path] = gpt_log_probs_and_entropy(
                    model,
                    labels=labels,
                    temperature=local_temperature,
                    return_entropy=False,
                    return_sum_pi_squared=True,
                    **inputs,
                )
            assert ent is None and lp.shape == out[path].shape == labels.shape
        logits = model(**inputs)  # [b, s_local, V/tp]
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    probs = torch.softmax(logits.double() / local_temperature.unsqueeze(-1), dim=-1)
    return out, torch.where(labels == -100, 0.0, (probs * probs).sum(-1))


def test_sum_pi_squared_through_the_model_tp_sp_and_cp(check):
    """Σπ² from the model path (hook and fallback) under TP 2 + SP and TP 2 × CP 2 + SP equals the
    TP 1 model's (this rank's CP part) and fp64 from the layout's gathered logits; padded and packed."""
    require_ranks(4, "TP2 × CP2")
    torch.manual_seed(shared_seed())
    batches = {kind: _cp_batch(kind, 2) for kind in ("padded", "packed")}
    temperatures = {k: 0.5 + torch.rand(b.labels.shape, dtype=torch.float64).to(DEVICE) for k, b in batches.items()}
    single = {}
    with model_parallel(1):
        for kind, batch in batches.items():
            out, ref = _sum_pi_squared_run(1, 1, batch, temperatures[kind])
            check.case(f"tp1 {kind}")
            check.close("sum_pi_squared", out["fallback"], ref, tol=1e-12, kind="Σπ² TP1 vs fp64")
            single[kind] = out["fallback"]
    for tp, cp in ((2, 1), (2, 2)):
        with model_parallel(tp, cp):
            rank = parallel_state.get_context_parallel_rank()
            for kind, batch in batches.items():
                out, ref = _sum_pi_squared_run(tp, cp, batch, temperatures[kind])
                expected = split_for_cp(single[kind], cp, rank, seq_dim=1, cu_seqlens=batch.cu_seqlens)
                check.case(f"tp{tp} cp{cp} sp {kind}")
                for path, value in out.items():
                    check.close(f"sum_pi_squared[{path}]", value, ref, tol=1e-12, kind="Σπ² model path vs fp64")
                    check.close(f"sum_pi_squared[{path}]", value, expected, tol=1e-10, kind="Σπ² vs TP1")
    check.done()


def _megatron_sp_grad_reduction():
    """Megatron's all-reduce of SP-replicated parameters' gradients over TP (finalize_model_grads uses it)."""
    import importlib

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the module, not the function
    reduce = getattr(fmg, "_allreduce_non_tensor_model_parallel_grads", None) or fmg._allreduce_layernorm_grads
    return reduce


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sp_norm_gradients_reduced_as_megatron_reduces_te_norms(tp: int, check):
    """The SP torch norms (SequenceParallelTorchNorm) under SP: their gradients are partial sums over
    each rank's sequence shard until Megatron's own TP all-reduce of ``sequence_parallel``
    parameters (what ``finalize_model_grads`` runs for TransformerEngine's norms); after it, every
    parameter's gradient equals the same model's without SP. Packed and padded batches."""
    from megatron.core.distributed import DistributedDataParallelConfig

    require_ranks(tp, f"TP{tp}")
    torch.manual_seed(shared_seed())
    reduce = _megatron_sp_grad_reduction()
    for kind in ("padded", "packed"):
        batch = synthetic_batch(kind, vocab_size=VOCAB, seq_length=SEQ, device=DEVICE)
        g_lp = torch.randn(batch.labels.shape, dtype=torch.float64).to(DEVICE)
        g_ent = torch.randn(batch.labels.shape, dtype=torch.float64).to(DEVICE)
        grads = {}
        with model_parallel(tp):
            for sp in (False, True):
                model = _model(tied=False, sp=sp)
                install_fused_head(model, temperature=TEMPERATURE, backend="torch")
                lp, ent = gpt_log_probs_and_entropy(model, labels=batch.labels, **batch.model_inputs())
                weighted_backward(lp, ent, g_lp, g_ent)
                if sp:
                    norms = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
                    partial = {n: p.grad.clone() for n, p in model.named_parameters() if n in norms}
                    model.ddp_config = DistributedDataParallelConfig()  # what the reduction reads of a DDP chunk
                    reduce([model], model.config)
                grads[sp] = pop_parameter_grads(model)
        check.case(f"tp{tp} {kind}")
        if not norms or not any("layernorm" in n for n in norms):
            check.fail(f"no SP-marked norm parameters: {sorted(norms)}")
        if all(torch.allclose(partial[n], grads[False][n]) for n in norms):
            check.fail("SP norm gradients were complete before the reduction: the test cannot see it")
        for name in sorted(grads[False]):
            check.close(f"grad {name}", grads[True][name], grads[False][name], tol=1e-9, kind=f"SP vs no SP ({kind})")
    check.done()
