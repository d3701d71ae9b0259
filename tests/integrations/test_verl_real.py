"""verl's *real* source (the verl 0.9.1 wheel) with and without the plugin.

``tests/test_verl_plugin.py`` covers the plugin against a stand-in verl tree, on every CI run.
This file runs where verl itself is installed (``scripts/install_verl_for_tests.sh``, which CI
runs; ``scripts/gpu_suite.sh`` carries the same wheels to the GPU) and skips elsewhere, saying so:

- ``import verl`` itself loads the plugin through ``VERL_USE_EXTERNAL_MODULES`` (and through its
  ``verl.plugins`` entry point where mcore_ppo is pip-installed), in a fresh interpreter;
- verl's Megatron fused forward (``fused_forward_model_gen``: packed THD micro-batch, its
  pre/post-processing, both routes: megatron-core >= 0.18's ``output_processor`` hook and the
  older patched ``GPTModel.forward``) on a small rotary GPT: log-probs, entropy and every
  parameter's gradient with the plugin equal those of the same verl code with an fp64 full-logits
  kernel swapped in, and, on CUDA, those of verl's own Triton kernel.

Where Ray is not installed (its 79 MB wheel does not travel to the GPU box), a stand-in answers
``import ray`` (``mcore_ppo_testing.real_verl``): verl imports Ray at module level but this path
never calls it (a call would raise).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_ppo import build_gpt_model
from mcore_ppo.integrations import verl as plugin
from mcore_ppo_testing.gpt_reference import pop_parameter_grads
from mcore_ppo_testing.layer_specs import local_gpt_spec
from mcore_ppo_testing.real_verl import RAY_STANDIN, loaded_modules, ray_missing, use_ray_standin
from mcore_ppo_testing.reference import normwise_relative_error, reference_outputs
from mcore_ppo_testing.seeds import next_seed

REPO = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
# verl's kernel needs hidden % 128 == 0 and runs bf16 on CUDA; fp64 on the CPU keeps the
# plugin-vs-reference comparison at rounding level.
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float64
VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 512, 128, 4, 2, 24
TEMPERATURE = 0.7

if importlib.util.find_spec("verl") is None:
    pytest.skip(
        "verl is not installed (bash scripts/install_verl_for_tests.sh); the stand-in tree covers the plugin "
        "in tests/test_verl_plugin.py",
        allow_module_level=True,
    )


def _child_env(**env: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "MCORE_PPO_VERL"))}
    paths = [str(REPO), environ.get("PYTHONPATH", "")]
    if ray_missing():
        paths.append(str(RAY_STANDIN))
    environ.update(env, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    return environ


_CHILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import verl
import verl.models.mcore.model_forward_fused as fused
from verl.utils.kernel import linear_cross_entropy as kernel
bound = fused.linear_cross_entropy
name = "verl's kernel" if bound is kernel.linear_cross_entropy else bound.__module__
print(json.dumps({"version": getattr(verl, "__version__", "?"), "bound": name}))
"""


def _import_real_verl_in_child(**env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=_child_env(**env), capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_real_verl_loads_the_plugin_when_asked():
    off = _import_real_verl_in_child(VERL_USE_EXTERNAL_MODULES="mcore_ppo.integrations.verl", MCORE_PPO_VERL="0")
    on = _import_real_verl_in_child(VERL_USE_EXTERNAL_MODULES="mcore_ppo.integrations.verl")
    print(f"verl {on['version']}: off -> {off['bound']}, on -> {on['bound']}")
    assert off["bound"] == "verl's kernel"
    assert on["bound"] == "mcore_ppo.integrations.verl"


def test_real_verl_entry_point_switch():
    points = importlib.metadata.entry_points(group="verl.plugins")
    if not any(p.value == "mcore_ppo.integrations.verl" for p in points):
        pytest.skip("mcore_ppo is not pip-installed here, so verl.plugins has no entry point for it")
    assert _import_real_verl_in_child()["bound"] == "verl's kernel"  # loaded, not asked
    assert _import_real_verl_in_child(MCORE_PPO_VERL="1")["bound"] == "mcore_ppo.integrations.verl"


@pytest.fixture(scope="module")
def verl_fused():
    """verl's ``model_forward_fused`` module (real ``import verl``), cleaned out of the process after."""
    added = use_ray_standin()
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("VERL_", "MCORE_PPO_VERL"))}
    try:
        import verl.models.mcore.model_forward_fused as fused

        yield fused
    finally:
        plugin.uninstall()
        for name in loaded_modules("verl", "ray"):
            del sys.modules[name]
        if added:
            sys.path.remove(str(RAY_STANDIN))
        os.environ.update(saved)


def _unwrap_with_classes_only(fused) -> None:
    """verl 0.9.1's ``unwrap_model`` checks ``isinstance`` against Megatron-FSDP's adapter too,
    which megatron-core 0.20 without TransformerEngine replaces by a placeholder *function*
    (TypeError). There, hand verl's own ``unwrap_model`` the wrapper classes that exist."""
    from verl.utils import megatron_utils

    wrappers = megatron_utils.ALL_MODULE_WRAPPER_CLASSNAMES
    if all(isinstance(cls, type) for cls in wrappers):
        return
    classes = tuple(cls for cls in wrappers if isinstance(cls, type))
    print(f"verl's wrapper classes without the placeholders: {[cls.__name__ for cls in classes]}")
    fused.unwrap_model = lambda model: megatron_utils.unwrap_model(model, classes)


def _fp64_kernel(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """verl's kernel contract on full fp64 logits: hidden flattened to ``[n, h]`` and labels to
    ``[n]`` by ``view`` (as verl's kernel does) -> fp32 ``([n], [n])``."""
    assert reduction == "none" and (dist_process_group is None or dist_process_group.size() == 1)
    flat_hidden = hidden.view(-1, hidden.shape[-1]).double()
    log_prob, entropy = reference_outputs(flat_hidden, weight.double(), labels.view(-1), temperature)
    return log_prob.float(), entropy.float()


def _batch(seed: int):
    """A right-padded ``[b, s]`` batch as verl's actor passes it (prompt tokens masked from the labels)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [SEQ, 17, 9]
    ids = torch.randint(0, VOCAB, (len(lengths), SEQ), generator=gen)
    attention_mask = torch.zeros(len(lengths), SEQ, dtype=torch.bool)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = True
    labels = torch.roll(ids, -1, dims=1)
    labels_mask = attention_mask.clone()
    labels_mask[:, -1] = False
    labels_mask[:, :3] = False  # the prompt
    positions = torch.arange(SEQ).expand(len(lengths), SEQ).contiguous()
    return [t.to(DEVICE) for t in (ids, positions, attention_mask, labels, labels_mask)]


def _run(fused, model, batch, kernel):
    """verl's fused forward with ``kernel`` bound where verl binds its own, then a backward."""
    saved = fused.linear_cross_entropy
    fused.linear_cross_entropy = kernel
    labels_mask = batch[-1]
    try:
        out = fused.fused_forward_model_gen()(model, *batch, TEMPERATURE, {})
        loss = (out["log_probs"] * labels_mask).sum() + 0.3 * (out["entropy"] * labels_mask).sum()
        loss.backward()
    finally:
        fused.linear_cross_entropy = saved
    # Gradients kept in their dtype: a cast would round apart equal values.
    grads = pop_parameter_grads(model)
    return out["log_probs"].detach().float() * labels_mask, out["entropy"].detach().float() * labels_mask, grads


@pytest.mark.usefixtures("megatron_tp1")
@pytest.mark.parametrize("route", ["hook", "legacy"])
def test_real_verl_fused_forward_with_and_without_the_plugin(verl_fused, route):
    fused = verl_fused
    model = build_gpt_model(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        params_dtype=DTYPE,
        seed=next_seed(),
        transformer_layer_spec=local_gpt_spec(attention="sdpa"),
        device=DEVICE,
        position_embedding_type="rope",
    )
    hook_available = fused._supports_output_processor_hook(model)
    if route == "hook" and not hook_available:
        pytest.skip("this megatron-core's GPTModel.forward has no output_processor hook (< 0.18)")
    setattr(model, fused._FUSED_FORWARD_MODE_ATTR, fused._HOOK_MODE if route == "hook" else fused._LEGACY_MODE)
    _unwrap_with_classes_only(fused)
    fused.patch_fused_forward(model)
    batch = _batch(next_seed())
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verls_kernel

    assert fused.linear_cross_entropy is verls_kernel

    reference = _run(fused, model, batch, _fp64_kernel)
    plugin.install()
    try:
        assert fused.linear_cross_entropy is plugin.linear_cross_entropy
        mine = _run(fused, model, batch, plugin.linear_cross_entropy)
    finally:
        plugin.uninstall()
    assert fused.linear_cross_entropy is verls_kernel

    # fp64 model on the CPU: the head's fp32 outputs and gradient (its contract: fp32 rounding,
    # ~1e-7 relative in the layers' gradients). bf16 on CUDA: the head's fp32 result against the fp64
    # kernel on the same bf16 hidden states is ~1e-6; the bf16 backward through the layers adds
    # bf16 rounding of the gradients (2^-8 relative).
    out_tol = {"rtol": 1e-9, "atol": 1e-9} if DTYPE == torch.float64 else {"rtol": 1e-5, "atol": 2e-5}
    # bf16: gradients accumulate in bf16 through the layers (the embedding's over every token), so
    # they are compared normwise, ‖a − b‖ / ‖b‖ per parameter; a d_hidden off by a TP factor or a
    # wrong token pairing gives O(1) there.
    grad_tol = {"rtol": 1e-6, "atol": 1e-8} if DTYPE == torch.float64 else {"normwise": 1e-2}
    _assert_same(mine, reference, out_tol, grad_tol, "plugin vs fp64")
    if DEVICE.type == "cuda":
        verls = _run(fused, model, batch, verls_kernel)
        _assert_same(mine, verls, {"rtol": 2e-3, "atol": 2e-3}, grad_tol, "plugin vs verl's kernel")
        print(
            f"route {route}: |log_prob - verl| max {(mine[0] - verls[0]).abs().max():.2e}, "
            f"|entropy - verl| max {(mine[1] - verls[1]).abs().max():.2e}, "
            f"|log_prob - fp64| max {(mine[0] - reference[0]).abs().max():.2e}"
        )
    if route == "legacy":
        fused.unpatch_fused_forward(model)


def _assert_same(mine, theirs, out_tol, grad_tol, what):
    for a, b, name in ((mine[0], theirs[0], "log_probs"), (mine[1], theirs[1], "entropy")):
        assert a.shape == b.shape, f"{what}: {name} shape {a.shape} vs {b.shape}"
        torch.testing.assert_close(a, b, **out_tol, msg=lambda m, n=name: f"{what}: {n}: {m}")
    assert mine[2].keys() == theirs[2].keys()
    for name, grad in mine[2].items():
        if "normwise" in grad_tol:
            error = normwise_relative_error(grad, theirs[2][name])
            assert error <= grad_tol["normwise"], f"{what}: grad {name}: normwise relative error {error:.2e}"
        else:
            message = lambda m, n=name: f"{what}: grad {n}: {m}"
            torch.testing.assert_close(grad, theirs[2][name], **grad_tol, msg=message)
