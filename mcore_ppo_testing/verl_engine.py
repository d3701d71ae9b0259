"""verl's Megatron engine forward, as verl runs it, on a Megatron ``GPTModel`` (tests, comparisons).

verl's actor and reference workers compute log-probs and entropy in
``MegatronEngineWithLMHead.forward_step`` (``verl/workers/engine/megatron/transformer_impl.py``):
with ``use_fused_kernels`` on it calls ``fused_forward_model_engine`` (packed THD, labels rolled
and CP-split by verl, then the ``output_processor`` hook of megatron-core >= 0.18 or the patched
``GPTModel.forward``, both ending in ``linear_cross_entropy``); with it off, verl's non-fused
``gptmodel_forward_model_engine`` computes full logits and verl's ``_lm_head_logits_processor``
takes log-probs and entropy from them. This module runs that very ``forward_step`` (verl's
class, verl's code) on an engine object that holds only what ``forward_step`` and
``_maybe_enable_fused_kernels`` read (:func:`make_engine`), with a micro-batch built the way
verl's engine receives it (:func:`make_batch`: nested jagged ``input_ids``/``loss_mask``, a
per-sample ``temperature`` tensor, non-tensor flags).

:func:`verl_log_probs` is the one-call entry for other harnesses: a model, token sequences,
optional per-sequence temperatures -> per-token log-probs and entropy, one plain 1-D tensor per
sequence. Read from verl 0.9.1 (the wheel) and verl-project/verl at 1dda039b: the same
``forward_step`` / ``fused_forward_model_engine`` in both.

The caller sets up Megatron's ``parallel_state`` (and, on CPU, ``mcore_ppo_testing.cpu_shims``:
verl moves the batch to ``torch.cuda.current_device()``). Where Ray is not installed a stand-in
answers ``import ray`` (:mod:`mcore_ppo_testing.real_verl`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from mcore_ppo_testing.real_verl import use_ray_standin

__all__ = [
    "GradRun",
    "VerlTokenOutputs",
    "forward_backward",
    "fp64_kernel",
    "import_verl_engine",
    "kernel_in_place_of_verls",
    "make_batch",
    "make_engine",
    "megatron_hook_route",
    "mtp_block_spec",
    "plugin_on",
    "run_forward_step",
    "verl_log_probs",
]

# An architecture name verl's registry accepts for a plain GPT (no VLM path).
ARCHITECTURE = "Qwen2ForCausalLM"


def import_verl_engine() -> ModuleType:
    """verl's ``transformer_impl`` module (the Ray stand-in first where Ray is missing).

    megatron-core 0.20 without TransformerEngine replaces Megatron-FSDP's adapter class by a
    placeholder *function*, which breaks the ``isinstance`` in verl's ``unwrap_model``; there verl's
    ``unwrap_model`` is given the wrapper classes that exist (its default argument only).
    """
    use_ray_standin()
    import verl.workers.engine.megatron.transformer_impl as transformer_impl
    from verl.utils import megatron_utils

    (wrappers,) = megatron_utils.unwrap_model.__defaults__
    if not all(isinstance(cls, type) for cls in wrappers):
        megatron_utils.unwrap_model.__defaults__ = (tuple(cls for cls in wrappers if isinstance(cls, type)),)
    return transformer_impl


def make_engine(
    model: torch.nn.Module,
    *,
    use_fused_kernels: bool = True,
    use_remove_padding: bool = True,
    mtp: bool = False,
    mtp_train: bool = False,
    value_model: bool = False,
    pad_token_id: int = 0,
) -> Any:
    """A verl ``MegatronEngineWithLMHead`` (``MegatronEngineWithValueHead`` for ``value_model``)
    holding ``model``, with verl's own ``_maybe_enable_fused_kernels`` run on it as verl's
    ``initialize`` does (it patches the model's forward for the fused path, or turns the fused
    path off for MTP, value models and runs without remove-padding), then, with ``mtp``
    (``actor_rollout_ref.model.mtp.enable``; ``mtp_train``: ``mtp.enable_train``), verl's MTP
    patches (``patch_engine_mtp``), as ``initialize`` applies them. A model verl patched before is
    unpatched first."""
    transformer_impl = import_verl_engine()
    cls = transformer_impl.MegatronEngineWithValueHead if value_model else transformer_impl.MegatronEngineWithLMHead
    engine = object.__new__(cls)
    engine.engine_config = SimpleNamespace(
        use_fused_kernels=use_fused_kernels,
        use_remove_padding=use_remove_padding,
        pad_to_length=False,
        pad_to_length_bucket=None,
        dynamic_context_parallel=False,
        entropy_from_logits_with_chunking=False,
        entropy_from_logits_chunk_size=2048,
        context_parallel_size=1,
    )
    engine.model_config = SimpleNamespace(
        hf_config=SimpleNamespace(architectures=[ARCHITECTURE]),
        tokenizer=SimpleNamespace(pad_token_id=pad_token_id),
        mtp=SimpleNamespace(enable=mtp, enable_train=mtp_train, detach_encoder=False),
    )
    engine.is_value_model = value_model
    engine.enable_routing_replay = False
    engine.tf_config = model.config
    engine.module = [model]
    from verl.models.mcore.model_forward_fused import unpatch_fused_forward

    # One engine per model, set up once, as in verl: a model reused here gets its own forward
    # back first, so verl binds its fused forward as it is now (the plugin on or off).
    unpatch_fused_forward(model)
    _unpatch_mtp(model)
    engine._maybe_enable_fused_kernels()
    if mtp:
        from verl.utils.megatron_utils import patch_engine_mtp

        with contextlib.redirect_stdout(io.StringIO()):  # verl prints the whole module here
            patch_engine_mtp(engine.module, engine.model_config)
    return engine


def _unpatch_mtp(model: torch.nn.Module) -> None:
    """verl's MTP patch of ``_postprocess`` taken off (verl's ``patch_postprocess`` would back up
    an already patched one), so each engine binds the postprocess in place now."""
    from verl.models.mcore.mtp_patch import _get_patching_model

    gpt = _get_patching_model(model)
    if gpt is not None and hasattr(gpt, "_postprocess_backup"):
        del gpt._postprocess_backup
        gpt.__dict__.pop("_postprocess", None)


def make_batch(
    sequences: Sequence[Sequence[int] | torch.Tensor],
    temperature: float | Sequence[float] | torch.Tensor | None = None,
    *,
    calculate_entropy: bool = True,
    device: torch.device | str = "cpu",
    loss_mask: Sequence[Sequence[int] | torch.Tensor] | None = None,
) -> Any:
    """One micro-batch as verl's Megatron engine receives it: a TensorDict with nested jagged
    ``input_ids`` and ``loss_mask`` (``[b, j]``; ``loss_mask`` one 0/1 row per sequence, its
    length, default all ones), a per-sample fp32 ``temperature`` ``[b]`` (a float is repeated),
    and the non-tensor flags ``forward_step`` reads."""
    from tensordict import NonTensorData, TensorDict

    rows = [torch.as_tensor(seq, dtype=torch.long).reshape(-1).cpu() for seq in sequences]
    if not rows or any(row.numel() < 2 for row in rows):
        raise ValueError("sequences must be a non-empty list of token sequences of at least 2 tokens each")
    if temperature is None:
        temperature = 1.0
    temps = torch.as_tensor(temperature, dtype=torch.float32).reshape(-1)
    if temps.numel() == 1:
        temps = temps.expand(len(rows)).clone()
    if temps.numel() != len(rows):
        raise ValueError(f"temperature must be a float or one value per sequence ({len(rows)}), got {temps.numel()}")
    input_ids = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    if loss_mask is None:
        masks = [torch.ones_like(row) for row in rows]
    else:
        masks = [torch.as_tensor(mask, dtype=torch.long).reshape(-1).cpu() for mask in loss_mask]
        if [m.numel() for m in masks] != [row.numel() for row in rows]:
            raise ValueError("loss_mask must have one row per sequence, as long as the sequence")
    loss_mask = torch.nested.as_nested_tensor(masks, layout=torch.jagged)
    batch = TensorDict(
        {"input_ids": input_ids, "loss_mask": loss_mask, "temperature": temps}, batch_size=[len(rows)]
    ).to(device)
    batch["calculate_entropy"] = NonTensorData(calculate_entropy)
    return batch


def run_forward_step(engine: Any, model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """verl's ``forward_step`` on one micro-batch: its output dict (nested ``[b, j]`` tensors:
    ``log_probs``, and ``entropy`` when the batch asks for it), still attached to the graph."""
    # verl hands forward_step a loss function and its postprocess (the schedule's loss_func);
    # the outputs are what is compared here, so neither runs.
    output, _loss_func = type(engine).forward_step(engine, iter([batch]), model, None, _no_postprocess)
    return output


def _no_postprocess(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("verl's postprocess_micro_batch_func is not run by this harness")


@contextlib.contextmanager
def plugin_on(backend: str | None = None) -> Iterator[None]:
    """The mcore_ppo verl plugin switched on inside (``MCORE_PPO_VERL_BACKEND`` = ``backend``
    when given), off after if it was off before."""
    from mcore_ppo.integrations import verl as plugin

    saved = os.environ.get("MCORE_PPO_VERL_BACKEND")
    if backend is not None:
        os.environ["MCORE_PPO_VERL_BACKEND"] = backend
    was_on = plugin.is_installed()
    plugin.install()
    try:
        yield
    finally:
        if not was_on:
            plugin.uninstall()
        if backend is not None:
            if saved is None:
                os.environ.pop("MCORE_PPO_VERL_BACKEND", None)
            else:
                os.environ["MCORE_PPO_VERL_BACKEND"] = saved


@dataclass
class VerlTokenOutputs:
    """Per-sequence results in a plain layout: ``log_probs[i][j]`` is the log-probability of
    ``sequences[i][j + 1]`` after ``sequences[i][: j + 1]`` and ``entropy[i][j]`` the entropy of
    that next-token distribution (both ``[len_i - 1]``, fp32, detached). ``entropy`` is None
    when not asked for. ``raw`` is verl's own output dict (nested, one value per input token:
    the last is the wrapped-around label verl's loss mask drops)."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None
    raw: dict[str, torch.Tensor]


def verl_log_probs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int] | torch.Tensor],
    temperature: float | Sequence[float] | torch.Tensor | None = None,
    *,
    calculate_entropy: bool = True,
    use_fused_kernels: bool = True,
    plugin: bool = True,
    backend: str | None = None,
) -> VerlTokenOutputs:
    """verl's live Megatron forward (``forward_step`` -> ``fused_forward_model_engine``) on
    ``model`` with the mcore_ppo plugin on: per-token log-probs and entropy of ``sequences``.

    Args:
        model: a Megatron ``GPTModel`` (or a wrapper verl's ``unwrap_model`` unwraps) on the
            current ``parallel_state``; with ``use_fused_kernels`` verl patches its forward
            (legacy route, megatron-core < 0.18) and this leaves it patched.
        sequences: token ids, one list or 1-D tensor per sequence (>= 2 tokens each).
        temperature: one float, or one per sequence (verl's per-sample temperature).
        calculate_entropy: verl's ``calculate_entropy`` flag.
        use_fused_kernels: verl's ``actor_rollout_ref.model.use_fused_kernels``; False runs
            verl's non-fused logits path instead (the plugin plays no part there).
        plugin: switch the plugin on for the call (False: verl's own kernel, CUDA only).
        backend: the plugin's backend (``MCORE_PPO_VERL_BACKEND``); None keeps the environment's.

    Returns:
        :class:`VerlTokenOutputs`. Runs under ``torch.no_grad``; for gradients call
        :func:`make_engine`, :func:`make_batch` and :func:`run_forward_step` directly.
    """
    device = next(model.parameters()).device
    switch = plugin_on(backend) if plugin else contextlib.nullcontext()
    # The plugin goes on before verl's engine is set up, as in verl (it loads with ``import verl``):
    # verl binds its fused GPTModel.forward to the model at set-up.
    with switch, torch.no_grad():
        engine = make_engine(model, use_fused_kernels=use_fused_kernels)
        batch = make_batch(sequences, temperature, calculate_entropy=calculate_entropy, device=device)
        raw = run_forward_step(engine, model, batch)
    log_probs = [row[:-1].detach().float() for row in raw["log_probs"].unbind()]
    entropy = None
    if calculate_entropy:
        entropy = [row[:-1].detach().float() for row in raw["entropy"].unbind()]
    return VerlTokenOutputs(log_probs, entropy, raw)


@dataclass
class GradRun:
    """One forward and backward through verl's ``forward_step``: every token's log-prob and
    entropy (verl's nested outputs flattened, fp64, detached; ``entropy`` None when not asked
    for) and every parameter's gradient by name."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    grads: dict[str, torch.Tensor]
    mtp_losses: dict[str, float] = dataclasses.field(default_factory=dict)


def forward_backward(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int] | torch.Tensor],
    temperature: float | Sequence[float] | torch.Tensor | None = None,
    *,
    use_fused_kernels: bool = True,
    calculate_entropy: bool = True,
    grad_seed: int = 0,
    mtp: bool = False,
    mtp_train: bool = False,
    loss_mask: Sequence[Sequence[int] | torch.Tensor] | None = None,
) -> GradRun:
    """verl's ``forward_step`` on ``sequences`` (whatever kernel and plugin state is in place),
    then a backward of ``sum(a * log_probs + b * entropy)`` with fixed random per-token ``a``,
    ``b`` drawn from ``grad_seed`` (the same for every run and rank). Under CP verl gathers the
    outputs of every rank (the others' detached), so every token's values come back on each rank
    and each rank's gradients are its share, as in verl.

    With ``mtp`` the engine has verl's MTP settings (``mtp_train``: ``mtp.enable_train``): the
    MTP losses Megatron's tracker collected in the forward come back as verl reads them
    (``get_megatron_mtp_loss``, a collective over the data-parallel group), and parameters that
    get no gradient (the MTP layers when MTP does not train) are left out of ``grads``."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from mcore_ppo_testing.gpt_reference import pop_parameter_grads

    device = next(model.parameters()).device
    engine = make_engine(model, use_fused_kernels=use_fused_kernels, mtp=mtp, mtp_train=mtp_train)
    MTPLossLoggingHelper.tracker.clear()
    batch = make_batch(sequences, temperature, calculate_entropy=calculate_entropy, device=device, loss_mask=loss_mask)
    for param in model.parameters():
        param.grad = None
    raw = run_forward_step(engine, model, batch)
    log_probs = raw["log_probs"].values()
    gen = torch.Generator().manual_seed(grad_seed)
    a, b = (torch.randn(log_probs.numel(), generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    loss = (log_probs.double() * a).sum()
    entropy = None
    if calculate_entropy:
        entropy = raw["entropy"].values()
        loss = loss + (entropy.double() * b).sum()
        entropy = entropy.detach().double()
    loss.backward()
    mtp_losses: dict[str, float] = {}
    if mtp:
        from verl.utils.megatron_utils import get_megatron_mtp_loss

        mtp_losses = get_megatron_mtp_loss(1)
        MTPLossLoggingHelper.tracker.clear()
        grads = {}
        for name, param in model.named_parameters():
            if param.grad is not None:  # None: the MTP layers when MTP does not train
                grads[name] = param.grad.detach().clone()
                param.grad = None
    else:
        grads = pop_parameter_grads(model)
    return GradRun(log_probs.detach().double(), entropy, grads, mtp_losses)


def fp64_kernel(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | None = 1.0,
    reduction: str | None = "none",
    dist_process_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's kernel contract on one rank by full fp64 logits: ``hidden`` flattened to ``[n, h]``
    and ``labels`` to ``[n]`` by ``view`` (as verl's kernel does) -> fp32 ``([n], [n])``."""
    from mcore_ppo_testing.reference import reference_outputs

    if reduction not in (None, "none") or (dist_process_group is not None and dist_process_group.size() != 1):
        raise ValueError("fp64_kernel: one rank and reduction='none' only")
    flat_hidden = hidden.view(-1, hidden.shape[-1]).double()
    log_prob, entropy = reference_outputs(flat_hidden, weight.double(), labels.view(-1), temperature or 1.0)
    return log_prob.float(), entropy.float()


@contextlib.contextmanager
def kernel_in_place_of_verls(kernel: Any) -> Iterator[None]:
    """``kernel`` bound where verl binds its ``linear_cross_entropy`` (``model_forward_fused``),
    verl's own kernel back after. With the plugin off, verl's fused path then runs ``kernel``."""
    import verl.models.mcore.model_forward_fused as fused

    saved = fused.linear_cross_entropy
    fused.linear_cross_entropy = kernel
    try:
        yield
    finally:
        fused.linear_cross_entropy = saved


class _PostprocessHookGPT:
    """Mixed into a ``GPTModel`` subclass by :func:`megatron_hook_route`: ``forward`` takes
    megatron-core >= 0.18's ``output_processor`` / ``output_processor_context`` and hands them to
    ``self._postprocess`` (verl's MTP patch, where the engine applied it), as megatron-core >= 0.18's
    ``GPTModel.forward`` does; the rest is the installed ``GPTModel.forward``."""

    def forward(self, *args: Any, output_processor: Any = None, output_processor_context: Any = None, **kwargs: Any):
        if output_processor is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        had_own = "_postprocess" in self.__dict__
        postprocess = self._postprocess
        self._postprocess = functools.partial(
            postprocess, output_processor=output_processor, output_processor_context=output_processor_context
        )
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            if had_own:
                self._postprocess = postprocess
            else:
                del self._postprocess


@contextlib.contextmanager
def megatron_hook_route(model: torch.nn.Module) -> Iterator[None]:
    """Inside, verl sees ``model`` (an unwrapped ``GPTModel``) as megatron-core >= 0.18 shows it:
    ``forward`` takes ``output_processor``, so verl's engines set up inside take the hook route
    (``fused_output_processor`` through ``GPTModel._postprocess``) instead of patching ``forward``.
    On megatron-core >= 0.18 nothing changes. Engines made inside belong inside."""
    from verl.models.mcore.model_forward_fused import _FUSED_FORWARD_MODE_ATTR, unpatch_fused_forward

    from mcore_ppo.model import supports_output_processor

    if supports_output_processor(model):
        yield
        return
    original = type(model)
    unpatch_fused_forward(model)
    model.__dict__.pop(_FUSED_FORWARD_MODE_ATTR, None)
    model.__class__ = type(f"PostprocessHook{original.__name__}", (_PostprocessHookGPT, original), {})
    try:
        yield
    finally:
        model.__dict__.pop(_FUSED_FORWARD_MODE_ATTR, None)
        model.__class__ = original


def mtp_block_spec(config: Any, spec: Any) -> Any:
    """Megatron's local (no TransformerEngine) MTP block spec with norms that run under sequence
    parallelism (:class:`mcore_ppo_testing.norms.SequenceParallelTorchNorm`; Megatron's local
    ``WrappedTorchNorm`` refuses SP). For ``build_gpt_model(mtp_block_spec=...)``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend

    from mcore_ppo_testing.norms import SequenceParallelTorchNorm

    class _SequenceParallelNorms(LocalSpecProvider):
        def layer_norm(self, *args: Any, **kwargs: Any) -> type:
            return SequenceParallelTorchNorm

    return get_gpt_mtp_block_spec_for_backend(config=config, spec=spec, backend=_SequenceParallelNorms())
