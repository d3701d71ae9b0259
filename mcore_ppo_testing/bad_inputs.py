"""The head's entry points and the bad arguments each must refuse, for the one-contract tests.

Every entry point (:data:`ENTRY_POINTS`: the function, ``[..., k]`` labels, the head module,
verl's ``linear_cross_entropy``, the teacher's ``fused_topk`` and NeMo-RL's adapter) is called
on the same :class:`Case` with keyword overrides; :data:`BAD_ARGUMENTS` lists, per argument, the
overrides that make it bad, the exception type and a word its message must contain (the
argument's name). ``tests/core/test_entry_points_contract.py`` runs the table on one rank,
``tests/distributed/test_entry_points_bad_inputs.py`` with the bad argument on one TP rank only.
"""

from __future__ import annotations

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


#: name -> the entry point called on a case with keyword overrides (``hidden``, ``weight`` and
#: ``labels`` may be overridden too).
ENTRY_POINTS: dict[str, Callable] = {
    "api": _api,
    "ids": _ids,
    "head": _head,
    "verl": _verl,
    "topk": _topk,
    "nemo_rl": _nemo_rl,
}
ALL = frozenset(ENTRY_POINTS)
# The entry points that take the head's options per call (the module's are set when it is built).
OPTIONS = frozenset({"api", "ids", "verl", "topk"})


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
    labels = (case.ids if entry == "ids" else case.labels).clone()
    labels[1, 3] = case.vocab
    return {"labels": labels.t() if entry == "verl" else labels}


def _float_labels(case: Case, entry: str) -> dict:
    labels = case.ids if entry == "ids" else case.labels
    return {"labels": (labels.t() if entry == "verl" else labels).float()}


def _zero_temperature(case: Case, entry: str) -> dict:
    temperature = case.temperature * (case.labels != case.labels[1, 2])
    return {"temperature": temperature.t() if entry == "verl" else temperature}


BAD_ARGUMENTS = (
    BadArgument("hidden not floating point", lambda c, e: {"hidden": c.hidden.long()}, TypeError, ("hidden",)),
    BadArgument("hidden one token short", lambda c, e: {"hidden": c.hidden[:-1]}, ValueError, ("labels", "target")),
    BadArgument("weight of another dtype", lambda c, e: {"weight": c.weight.double()}, TypeError, ("weight",)),
    BadArgument("weight of another hidden size", lambda c, e: {"weight": c.weight[:, :-1]}, ValueError,
                ("hidden size",)),
    BadArgument("weight not a tensor", lambda c, e: {"weight": c.weight.tolist()}, TypeError, ("weight",)),
    BadArgument("labels of a float dtype", _float_labels, TypeError, ("labels",), ALL - {"nemo_rl"}),
    BadArgument("labels out of the vocab", _out_of_vocab, ValueError, ("labels",)),
    BadArgument("temperature a string", lambda c, e: {"temperature": "0.7"}, TypeError, ("temperature",)),
    BadArgument("temperature zero", lambda c, e: {"temperature": 0.0}, ValueError, ("temperature",)),
    BadArgument("temperature tensor of a wrong shape", lambda c, e: {"temperature": torch.ones(5)}, ValueError,
                ("temperature",), ALL - {"nemo_rl"}),
    BadArgument("temperature tensor with a zero", _zero_temperature, ValueError, ("temperature",),
                ALL - {"nemo_rl"}),
    BadArgument("ignore_index a string", lambda c, e: {"ignore_index": "x"}, TypeError, ("ignore_index",), OPTIONS),
    BadArgument("return_entropy an int", lambda c, e: {"return_entropy": 1}, TypeError, ("return_entropy",),
                ALL - {"topk"}),
    BadArgument("validate a string", lambda c, e: {"validate": "yes"}, TypeError, ("validate",), OPTIONS),
    BadArgument("return_sum_pi_squared a string", lambda c, e: {"return_sum_pi_squared": "yes"}, TypeError,
                ("return_sum_pi_squared",), frozenset({"api", "ids", "head"})),
    BadArgument("return_sum_pi_squared an int", lambda c, e: {"return_sum_pi_squared": 1}, TypeError,
                ("return_sum_pi_squared",), frozenset({"api", "ids", "head"})),
    BadArgument("backend an unknown name", lambda c, e: {"backend": "nope"}, ValueError, ("backend",),
                frozenset({"api", "ids", "verl", "nemo_rl"})),
    BadArgument("backend an int", lambda c, e: {"backend": 3}, TypeError, ("backend",),
                frozenset({"api", "ids", "verl", "nemo_rl"})),
    BadArgument("sequence_parallel an int", lambda c, e: {"sequence_parallel": 1}, TypeError, ("sequence_parallel",),
                frozenset({"api", "ids", "topk", "nemo_rl"})),
    BadArgument("reduction unknown", lambda c, e: {"reduction": "avg"}, ValueError, ("reduction",),
                frozenset({"verl"})),
    BadArgument("k zero", lambda c, e: {"k": 0}, ValueError, ("k must",), frozenset({"topk"})),
    BadArgument("k a float", lambda c, e: {"k": 2.0}, TypeError, ("k must",), frozenset({"topk"})),
    BadArgument("ids with k = 0", lambda c, e: {"labels": c.ids[..., :0]}, ValueError, ("labels",),
                frozenset({"ids"})),
)  # fmt: skip


def cases_for(entry: str) -> list[BadArgument]:
    """The bad arguments ``entry`` takes."""
    return [bad for bad in BAD_ARGUMENTS if entry in bad.entries]
