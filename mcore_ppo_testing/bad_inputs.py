"""The head's entry points and the bad arguments each must refuse, for the one-contract tests.

Every entry point (:data:`ENTRY_POINTS`: the function, ``[..., k]`` labels, the head module,
verl's ``linear_cross_entropy``, the teacher's ``fused_topk``, NeMo-RL's adapter, a Megatron
GPT through ``gpt_log_probs_and_entropy`` and ``run_head`` given ``given_statistics``, verl's
top-k distillation route) is called on the same :class:`Case` with keyword overrides;
:data:`BAD_ARGUMENTS` lists, per argument, the overrides that make it bad, the exception type
and a word its message must contain (the argument's name). ``tests/core/test_entry_points_contract.py``
runs the table on one rank, ``tests/distributed/test_entry_points_bad_inputs.py`` with the bad
argument on one TP rank only. The model's entry needs a case from :func:`with_model` (Megatron's
``parallel_state`` initialised, the CPU shims on the CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

IGNORE = -100
TOPK = 4


@dataclass(frozen=True)
class Case:
    """One rank's good inputs in Megatron's layout: hidden ``[s, b, h]`` (replicated over TP),
    this rank's weight shard, labels ``[b, s]`` and ``k`` ids ``[b, s, k]`` of the global vocab,
    a per-token temperature ``[b, s]``."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    ids: torch.Tensor
    temperature: torch.Tensor
    vocab: int
    tp_group: object = None
    tp_rank: int = 0
    model: torch.nn.Module | None = None  # a GPT whose output layer is the fused head (with_model)
    input_ids: torch.Tensor | None = None


def make_case(seed: int, *, tp: int = 1, tp_rank: int | None = 0, tp_group=None, device="cpu") -> Case:
    """A small fp32 case of a ``12·tp`` vocab, the same on every rank but for the weight shard
    (``seed`` shared); ``tp_rank`` None: the whole weight (the single-rank reference)."""
    gen = torch.Generator().manual_seed(seed)
    seq, batch, hidden_size, vocab = 8, 2, 16, 12 * tp
    hidden = torch.randn(seq, batch, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) / 4
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[:, 0] = IGNORE
    ids = torch.randint(0, vocab, (batch, seq, 3), generator=gen)
    ids[:, 0] = IGNORE
    temperature = 0.5 + torch.rand(batch, seq, generator=gen)
    shard = weight if tp_rank is None else weight.chunk(tp, dim=0)[tp_rank]
    to = {"device": torch.device(device)}
    return Case(
        hidden.to(**to), shard.to(**to), labels.to(**to), ids.to(**to), temperature.to(**to), vocab, tp_group,
        tp_rank or 0,
    )  # fmt: skip


def _api(case: Case, **kw):
    from mcore_ppo import fused_log_probs_and_entropy

    args = {"hidden": case.hidden, "weight": case.weight, "labels": case.labels, "temperature": case.temperature}
    args.update({"backend": "torch", **kw})
    return fused_log_probs_and_entropy(
        args.pop("hidden"), args.pop("weight"), args.pop("labels"), tp_group=case.tp_group, **args
    )


def _ids(case: Case, **kw):
    from mcore_ppo import fused_log_probs_at

    args = {"hidden": case.hidden, "weight": case.weight, "labels": case.ids, "temperature": case.temperature}
    args.update({"backend": "torch", **kw})
    return fused_log_probs_at(
        args.pop("hidden"), args.pop("weight"), args.pop("labels"), tp_group=case.tp_group, **args
    )


def _head(case: Case, **kw):
    from megatron.core.model_parallel_config import ModelParallelConfig

    from mcore_ppo import VocabParallelFusedPPOHead

    config = ModelParallelConfig(use_cpu_initialization=True, params_dtype=torch.float32)
    # The module's options are set when it is built; its per-call arguments come from ``kw``.
    head = VocabParallelFusedPPOHead(
        case.hidden.shape[-1], case.vocab, config=config, init_method=torch.nn.init.zeros_, backend="torch",
        skip_weight_param_allocation=True, tp_group=case.tp_group, validate=kw.pop("validate", None),
    )  # fmt: skip
    args = {"hidden": case.hidden, "weight": case.weight, "labels": case.labels, "temperature": case.temperature}
    args.update(kw)
    return head(args.pop("hidden"), args.pop("labels"), weight=args.pop("weight"), **args)


def _verl(case: Case, **kw):
    from mcore_ppo.integrations.verl.kernel import linear_cross_entropy

    # verl's pairing: labels in hidden's memory order ([s, b] for hidden [s, b, h]).
    args = {
        "hidden": case.hidden,
        "weight": case.weight,
        "labels": case.labels.t(),
        "temperature": case.temperature.t(),
    }
    args.update({"backend": "torch", "reduction": "none", **kw})
    tensors = args.pop("hidden"), args.pop("weight"), args.pop("labels"), args.pop("temperature")
    return linear_cross_entropy(*tensors, args.pop("reduction"), case.tp_group, reduce_hidden_grad=True, **args)


def _topk(case: Case, **kw):
    from mcore_ppo import fused_topk

    args = {"hidden": case.hidden, "weight": case.weight, "labels": case.labels, "temperature": case.temperature}
    args.update(kw)
    return fused_topk(
        args.pop("hidden"), args.pop("weight"), args.pop("k", TOPK), tp_group=case.tp_group, impl="torch", **args
    )


def _nemo_rl(case: Case, **kw):
    from mcore_ppo.integrations.nemo_rl.adapter import from_parallel_hidden_states_to_logprobs

    rank, rows = case.tp_rank, case.weight.shape[0] if isinstance(case.weight, torch.Tensor) else 0
    args = {"hidden": case.hidden, "weight": case.weight, "labels": case.labels, "temperature": 0.7}
    args.update({"backend": "torch", "sequence_parallel": False, **kw})
    return from_parallel_hidden_states_to_logprobs(
        args.pop("hidden"), args.pop("weight"), None, args.pop("labels"), rank * rows, (rank + 1) * rows, case.tp_group,
        **args,
    )  # fmt: skip


_OPTION_KEYWORDS = ("ignore_index", "backend", "return_entropy", "validate", "return_sum_pi_squared", "precision")


def finished_statistics(case: Case) -> dict[str, torch.Tensor]:
    """fp32 ``[s·b]`` ``lse``, entropy and Σπ² of the case's tokens in the head's row order
    (sequence major), from the whole weight (the shards all-gathered over the case's TP group) in
    fp64 by plain torch ops: what verl's route hands ``run_head`` as ``given_statistics``."""
    import torch.distributed as dist

    from mcore_ppo.parallel.ranks import group_size

    weight = case.weight
    if group_size(case.tp_group) > 1:
        shards = [torch.empty_like(weight) for _ in range(group_size(case.tp_group))]
        dist.all_gather(shards, weight.contiguous(), group=case.tp_group)
        weight = torch.cat(shards)
    rows = case.hidden.reshape(-1, case.hidden.shape[-1]).double()
    logits = rows @ weight.double().t() / case.temperature.t().reshape(-1, 1).double()
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.softmax(logits, dim=-1)
    values = {"lse": lse, "entropy": lse - (p * logits).sum(dim=-1), "sum_pi_squared": p.square().sum(dim=-1)}
    return {name: value.float() for name, value in values.items()}


def _normalizer(case: Case, **kw):
    """``run_head`` with ``k`` ids and ``given_statistics`` (the rows its options ask for), as
    verl's top-k distillation route calls it. A callable ``given_statistics`` override is
    applied to the good rows."""
    from mcore_ppo.head_call import attempt, run_head, statistics_of
    from mcore_ppo.options import DEFAULT_LAYOUT, DEFAULT_OPTIONS, call_options, megatron_layout

    # Every rank computes the good statistics in step (a collective), whatever is made bad after.
    values = finished_statistics(case)
    args = {"hidden": case.hidden, "weight": case.weight, "labels": case.ids, "temperature": case.temperature}
    args.update(kw)
    override = args.pop("given_statistics", None)
    chosen = dict.fromkeys(_OPTION_KEYWORDS)
    chosen.update(backend="torch", return_entropy=False)
    chosen.update({name: args.pop(name) for name in _OPTION_KEYWORDS if name in args})
    (options, layout), error = attempt(
        lambda: (call_options(None, **chosen), megatron_layout(False)), (DEFAULT_OPTIONS, DEFAULT_LAYOUT)
    )
    statistics = statistics_of(options)
    given = statistics.finished(values["lse"], values)
    given = override(given) if callable(override) else (given if override is None else override)
    return run_head(
        args.pop("hidden"), args.pop("weight"), args.pop("labels"), args.pop("temperature"), options,
        tp_group=case.tp_group, layout=layout, ids=True, prior_error=error, given_statistics=given,
    )  # fmt: skip


# The GPT of the model's entry: one layer, the case's vocab and hidden size.
_GPT = {"num_layers": 1, "num_attention_heads": 4, "ffn_hidden_size": 32}


def with_model(case: Case) -> Case:
    """``case`` with a Megatron GPT (vocab ``case.vocab``, hidden size as ``case.hidden``'s, on
    its device) whose output layer is the fused head (torch backend), built on the current
    ``parallel_state`` (its TP group becomes the case's), and input ids for ``case.labels``."""
    from megatron.core import parallel_state

    from mcore_ppo import install_fused_head
    from mcore_ppo_testing.gpt_builder import build_gpt_model

    seq = case.labels.shape[1]
    model = build_gpt_model(
        **_GPT, hidden_size=case.hidden.shape[-1], vocab_size=case.vocab, max_sequence_length=seq,
        device=case.hidden.device, seed=case.vocab,
    )  # fmt: skip
    install_fused_head(model, backend="torch")
    input_ids = torch.remainder(case.labels.roll(1, dims=1), case.vocab)
    return dataclasses.replace(
        case, model=model, input_ids=input_ids, tp_group=parallel_state.get_tensor_model_parallel_group(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
    )  # fmt: skip


def _model(case: Case, **kw):
    """:func:`mcore_ppo.gpt_log_probs_and_entropy` on ``case.model`` (:func:`with_model`); a
    ``validate`` keyword sets the head's option for this call."""
    from mcore_ppo import gpt_log_probs_and_entropy

    if case.model is None:
        raise RuntimeError("the model's entry needs a case from with_model(case)")
    head = case.model.output_layer
    args = {"labels": case.labels, "temperature": case.temperature}
    args.update(kw)
    before = head.validate
    if "validate" in args:
        head.validate = args.pop("validate")
    positions = torch.arange(case.labels.shape[1], device=case.labels.device).expand_as(case.labels)
    try:
        return gpt_log_probs_and_entropy(case.model, case.input_ids, positions, None, args.pop("labels"), **args)
    finally:
        head.validate = before


def model_reference(case: Case) -> torch.Tensor:
    """fp64 ``log p(label)`` ``[b, s]`` of ``case.model`` from its logits (the model's logits path,
    gathered over TP), at the case's per-token temperature."""
    from megatron.core import tensor_parallel

    from mcore_ppo.parallel.ranks import group_size

    positions = torch.arange(case.labels.shape[1], device=case.labels.device).expand_as(case.labels)
    with torch.no_grad():
        logits = case.model(case.input_ids, positions, None)
        if group_size(case.tp_group) > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    log_softmax = torch.log_softmax(logits.double() / case.temperature.double()[..., None], dim=-1)
    valid = case.labels != IGNORE
    picked = log_softmax.gather(-1, torch.where(valid, case.labels, 0)[..., None])[..., 0]
    return torch.where(valid, picked, 0.0)


#: name -> the entry point called on a case with keyword overrides (``hidden``, ``weight`` and
#: ``labels`` may be overridden too).
ENTRY_POINTS: dict[str, Callable] = {
    "api": _api,
    "ids": _ids,
    "head": _head,
    "verl": _verl,
    "topk": _topk,
    "nemo_rl": _nemo_rl,
    "model": _model,
    "normalizer": _normalizer,
}
ALL = frozenset(ENTRY_POINTS)
# The entry points given hidden states and a weight (the model's are its own).
TENSORS = ALL - {"model"}
# The entry points that take the head's options per call (the module's are set when it is built).
OPTIONS = frozenset({"api", "ids", "verl", "topk", "normalizer"})
# The entry points whose labels are k ids per token.
IDS = frozenset({"ids", "normalizer"})


@dataclass(frozen=True)
class BadArgument:
    """An argument made bad: ``overrides(case, entry)`` are the keywords that make it so for the
    entry point ``entry``; the message must contain one of ``names`` (the argument it names)."""

    name: str
    overrides: Callable[[Case, str], dict]
    error: type[Exception]
    names: tuple[str, ...]
    entries: frozenset = ALL


def _out_of_vocab(case: Case, entry: str) -> dict:
    labels = (case.ids if entry in IDS else case.labels).clone()
    labels[1, 3] = case.vocab
    return {"labels": labels.t() if entry == "verl" else labels}


def _float_labels(case: Case, entry: str) -> dict:
    labels = case.ids if entry in IDS else case.labels
    return {"labels": (labels.t() if entry == "verl" else labels).float()}


def _zero_temperature(case: Case, entry: str) -> dict:
    temperature = case.temperature * (case.labels != case.labels[1, 2])
    return {"temperature": temperature.t() if entry == "verl" else temperature}


BAD_ARGUMENTS = (
    BadArgument("hidden not floating point", lambda c, e: {"hidden": c.hidden.long()}, TypeError, ("hidden",),
                TENSORS),
    BadArgument("hidden one token short", lambda c, e: {"hidden": c.hidden[:-1]}, ValueError, ("labels", "target"),
                TENSORS),
    BadArgument("weight of another dtype", lambda c, e: {"weight": c.weight.double()}, TypeError, ("weight",),
                TENSORS),
    BadArgument("weight of another hidden size", lambda c, e: {"weight": c.weight[:, :-1]}, ValueError,
                ("hidden size",), TENSORS),
    BadArgument("weight not a tensor", lambda c, e: {"weight": c.weight.tolist()}, TypeError, ("weight",), TENSORS),
    BadArgument("labels of a float dtype", _float_labels, TypeError, ("labels",), ALL - {"nemo_rl"}),
    BadArgument("labels out of the vocab", _out_of_vocab, ValueError, ("labels",)),
    BadArgument("temperature a string", lambda c, e: {"temperature": "0.7"}, TypeError, ("temperature",)),
    BadArgument("temperature zero", lambda c, e: {"temperature": 0.0}, ValueError, ("temperature",)),
    BadArgument("temperature NaN", lambda c, e: {"temperature": float("nan")}, ValueError, ("temperature",)),
    BadArgument("temperature tensor of a wrong shape", lambda c, e: {"temperature": torch.ones(5)}, ValueError,
                ("temperature",), ALL - {"nemo_rl"}),
    BadArgument("temperature tensor with a zero", _zero_temperature, ValueError, ("temperature",),
                ALL - {"nemo_rl"}),
    BadArgument("ignore_index a string", lambda c, e: {"ignore_index": "x"}, TypeError, ("ignore_index",), OPTIONS),
    BadArgument("return_entropy an int", lambda c, e: {"return_entropy": 1}, TypeError, ("return_entropy",),
                ALL - {"topk"}),
    BadArgument("validate a string", lambda c, e: {"validate": "yes"}, TypeError, ("validate",), OPTIONS),
    BadArgument("return_sum_pi_squared a string", lambda c, e: {"return_sum_pi_squared": "yes"}, TypeError,
                ("return_sum_pi_squared",), frozenset({"api", "ids", "head", "model", "normalizer"})),
    BadArgument("return_sum_pi_squared an int", lambda c, e: {"return_sum_pi_squared": 1}, TypeError,
                ("return_sum_pi_squared",), frozenset({"api", "ids", "head", "model", "normalizer"})),
    BadArgument("precision unknown", lambda c, e: {"precision": "tf32"}, ValueError, ("precision",),
                frozenset({"api", "ids", "nemo_rl", "normalizer"})),
    BadArgument("precision an int", lambda c, e: {"precision": 3}, TypeError, ("precision",),
                frozenset({"api", "ids", "nemo_rl", "normalizer"})),
    BadArgument("precision a 16-bit weight cannot take", lambda c, e: {"weight": c.weight.bfloat16(),
                "precision": "fp32_faithful"}, TypeError, ("weight",), frozenset({"api", "ids", "nemo_rl"})),
    BadArgument("backend an unknown name", lambda c, e: {"backend": "nope"}, ValueError, ("backend",),
                frozenset({"api", "ids", "verl", "nemo_rl", "normalizer"})),
    BadArgument("backend an int", lambda c, e: {"backend": 3}, TypeError, ("backend",),
                frozenset({"api", "ids", "verl", "nemo_rl", "normalizer"})),
    BadArgument("sequence_parallel an int", lambda c, e: {"sequence_parallel": 1}, TypeError, ("sequence_parallel",),
                frozenset({"api", "ids", "topk", "nemo_rl"})),
    BadArgument("reduction unknown", lambda c, e: {"reduction": "avg"}, ValueError, ("reduction",),
                frozenset({"verl"})),
    BadArgument("k zero", lambda c, e: {"k": 0}, ValueError, ("k must",), frozenset({"topk"})),
    BadArgument("k a float", lambda c, e: {"k": 2.0}, TypeError, ("k must",), frozenset({"topk"})),
    BadArgument("ids with k = 0", lambda c, e: {"labels": c.ids[..., :0]}, ValueError, ("labels",), IDS),
    BadArgument("given_statistics of another dtype", lambda c, e: {"given_statistics": lambda g: g.double()},
                TypeError, ("given_statistics",), frozenset({"normalizer"})),
    BadArgument("given_statistics one token short", lambda c, e: {"given_statistics": lambda g: g[:, :-1]},
                ValueError, ("given_statistics",), frozenset({"normalizer"})),
    BadArgument("given_statistics not a tensor", lambda c, e: {"given_statistics": lambda g: g.tolist()},
                TypeError, ("given_statistics",), frozenset({"normalizer"})),
    BadArgument("given_statistics without the entropy's row",
                lambda c, e: {"return_entropy": True, "given_statistics": lambda g: g[:1]}, ValueError,
                ("given_statistics",), frozenset({"normalizer"})),
    BadArgument("given_statistics with a row too many", lambda c, e: {"given_statistics": lambda g: g[[0, 0]]},
                ValueError, ("given_statistics",), frozenset({"normalizer"})),
)  # fmt: skip


def cases_for(entry: str) -> list[BadArgument]:
    """The bad arguments ``entry`` takes."""
    return [bad for bad in BAD_ARGUMENTS if entry in bad.entries]
