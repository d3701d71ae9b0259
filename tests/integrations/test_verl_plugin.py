"""The verl plugin against a stand-in verl tree (``mcore_ppo_testing.fake_verl``: verl's plugin
loading, both ways (the ``verl.plugins`` entry points of verl >= 0.9 and the
``VERL_USE_EXTERNAL_MODULES`` list of verl <= 0.8, which later verl still honours), and its
modules' import-time binding of ``linear_cross_entropy``, read from verl's source). verl's real
engine path: ``tests/integrations/test_verl_live.py``; under TP/SP/CP:
``tests/distributed/test_verl_tp_cp.py``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from mcore_ppo.integrations import verl as plugin
from mcore_ppo.integrations.verl.kernel import linear_cross_entropy as compat_linear_cross_entropy
from mcore_ppo_testing.fake_verl import write_fake_verl
from mcore_ppo_testing.real_verl import loaded_modules

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["verl.plugins"]
FUSED = plugin.KERNEL_MODULE
OVERLAP = "verl.models.mcore.model_forward_1f1b_overlap"
KERNEL = "verl.utils.kernel.linear_cross_entropy"

_CHILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import verl
import verl.models.mcore.model_forward_fused as fused, verl.models.mcore.model_forward_1f1b_overlap as overlap
from verl.utils.kernel import linear_cross_entropy as kernel
print(json.dumps({m.__name__: m.linear_cross_entropy.__module__ for m in (fused, overlap)}
                 | {"kernel": kernel.linear_cross_entropy.__module__,
                    "wrapped": hasattr(fused.fused_output_processor, "__mcore_ppo_original__"),
                    "plugin imported": "mcore_ppo.integrations.verl" in sys.modules}))
"""


# What the stand-in verl imports that takes no part in the plugin's loading: imported once, by
# the fork server (mcore_ppo_testing.fork_server), not by every child.
PRELOADED = ("torch", "megatron.core")


def _import_verl_in_child(fork_server, tmp_path: Path, entry_points: dict, **env: str) -> tuple[dict, str]:
    """Import the stand-in verl (then its Megatron modules) in a fresh process with ``env``."""
    root = write_fake_verl(tmp_path / "site", entry_points)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "MCORE_PPO_VERL"))}
    environ.update(env, PYTHONPATH=os.pathsep.join([str(root), str(REPO), environ.get("PYTHONPATH", "")]))
    done = fork_server(*PRELOADED).run(_CHILD, env=environ, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_pyproject_declares_the_plugin():
    assert ENTRY_POINTS == {"mcore_ppo": "mcore_ppo.integrations.verl"}


# VERL_USE_EXTERNAL_PLUGINS=none where only VERL_USE_EXTERNAL_MODULES may load the plugin: mcore_ppo's
# own entry point (it is pip-installed here) would load it otherwise.
@pytest.mark.parametrize(
    "entry_points, env, switched",
    [
        (ENTRY_POINTS, {}, False),  # loaded as an entry point, not asked: verl untouched
        (ENTRY_POINTS, {"MCORE_PPO_VERL": "1"}, True),
        # verl <= 0.8: no entry points, the module named in VERL_USE_EXTERNAL_MODULES; naming it is asking
        ({}, {"VERL_USE_EXTERNAL_MODULES": "mcore_ppo.integrations.verl", "VERL_USE_EXTERNAL_PLUGINS": "none"}, True),
        (
            {},
            {
                "VERL_USE_EXTERNAL_MODULES": "mcore_ppo.integrations.verl",
                "VERL_USE_EXTERNAL_PLUGINS": "none",
                "MCORE_PPO_VERL": "0",
            },
            False,
        ),
        ({}, {"VERL_USE_EXTERNAL_PLUGINS": "none", "MCORE_PPO_VERL": "1"}, False),  # nothing loads the plugin
        (ENTRY_POINTS, {"MCORE_PPO_VERL": "1", "VERL_USE_EXTERNAL_PLUGINS": "none"}, False),  # verl loads no plugin
    ],
    ids=["entry-point-off", "entry-point-on", "external-modules", "external-modules-opted-out", "not-loaded",
         "plugins-disabled"],
)  # fmt: skip
def test_switch_through_verls_own_loading(fork_server, tmp_path, entry_points, env, switched):
    bound, log = _import_verl_in_child(fork_server, tmp_path, entry_points, **env)
    expected = "mcore_ppo.integrations.verl" if switched else KERNEL
    # verl's kernel module itself untouched; the 1F1B-overlap module keeps verl's kernel (no call site
    # there can say the model's SP setting).
    assert bound[FUSED] == expected and bound[OVERLAP] == KERNEL and bound["kernel"] == KERNEL
    assert bound["wrapped"] == switched
    if "VERL_USE_EXTERNAL_MODULES" in env:
        assert bound["plugin imported"]  # through verl's VERL_USE_EXTERNAL_MODULES alone
    assert ("mcore_ppo verl plugin: installed" in log) == switched
    assert "verl plugin: on:" not in log  # "on" only once the head has run
    assert "has no" not in log  # every function the plugin wraps is where it expects it


@pytest.fixture
def fake_verl(tmp_path, monkeypatch):
    """The stand-in tree importable in this process; verl's modules and the plugin reset after."""
    root = write_fake_verl(tmp_path / "site", {})
    monkeypatch.syspath_prepend(str(root))
    for name in ("MCORE_PPO_VERL", "MCORE_PPO_VERL_BACKEND", "MCORE_PPO_VERL_PRECISION", "VERL_USE_EXTERNAL_MODULES"):
        monkeypatch.delenv(name, raising=False)
    # Where the real verl is installed, other tests may have imported parts of it: set them aside.
    real = {name: sys.modules.pop(name) for name in loaded_modules("verl")}
    yield
    plugin.uninstall()
    for name in loaded_modules("verl"):
        del sys.modules[name]
    sys.modules.update(real)


def test_install_rebinds_loaded_modules_and_later_imports_idempotently(fake_verl):
    import verl.models.mcore.model_forward_fused as fused
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verls

    assert fused.linear_cross_entropy is verls
    plugin.install()
    plugin.install()  # idempotent
    assert plugin.is_installed() and fused.linear_cross_entropy is plugin.linear_cross_entropy
    processor = fused.fused_output_processor
    assert processor.__mcore_ppo_original__.__module__ == FUSED  # wrapped once, verl's inside
    assert sum(f is plugin._HOOK for f in sys.meta_path) == 1
    import verl.models.mcore.model_forward_1f1b_overlap as overlap  # imported after install: not a target

    assert overlap.linear_cross_entropy is verls
    plugin.uninstall()
    assert fused.linear_cross_entropy is verls and fused.fused_output_processor is processor.__mcore_ppo_original__
    assert plugin._HOOK not in sys.meta_path


@pytest.mark.usefixtures("megatron_tp1")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verls_fused_output_processor_with_and_without_the_plugin(fake_verl, monkeypatch, backend):
    """verl's hook route (its own fused_output_processor) gives equal values and gradients either way."""
    from mcore_ppo.backends import resolve_backend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # triton: the interpreter, or CUDA
    try:
        impl = resolve_backend(backend, device)
    except ValueError as err:  # triton without CUDA or the interpreter
        pytest.skip(str(err))
    reason = impl.unsupported(torch.empty(0, device=device))
    if reason:
        pytest.skip(reason)
    import verl.models.mcore.model_forward_fused as fused
    from verl.utils.kernel import linear_cross_entropy as kernel

    gen = torch.Generator().manual_seed(11)
    s, h, vocab = 12, 16, 40
    hidden = torch.randn(s, 1, h, generator=gen).to(device)  # verl's packed THD: [t, 1, h] with labels [1, t]
    weight = torch.randn(vocab, h, generator=gen).to(device)
    labels = torch.randint(0, vocab, (1, s), generator=gen).to(device)
    config = type("Config", (), {"sequence_parallel": False})()
    layer = type("Layer", (), {"weight": weight})()

    def run():
        x = hidden.clone().requires_grad_()
        out = fused.fused_output_processor(
            hidden_states=x, output_layer=layer, output_weight=None, labels=labels,
            context=fused.FusedOutputProcessorContext(temperature=0.7), config=config,
        )  # fmt: skip
        (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
        return out.log_probs.detach(), out.entropy.detach(), x.grad

    kernel.CALLS.clear()
    theirs = run()
    monkeypatch.setenv("MCORE_PPO_VERL_BACKEND", backend)
    plugin.install()
    mine = run()
    assert kernel.CALLS == ["verl"]  # the second run did not reach verl's kernel
    tol = {"rtol": 1e-4, "atol": 1e-5}  # fp32 sums in different orders
    for a, b in zip(mine, theirs, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    # The same call as mcore_ppo.integrations.verl.kernel (one rank: nothing to reduce).
    direct = compat_linear_cross_entropy(hidden, weight, labels, 0.7, "none", None, backend=backend)
    torch.testing.assert_close(mine[0], direct[0], **tol)


def test_bad_switch_and_backend_values(fake_verl, monkeypatch, caplog):
    monkeypatch.setenv("MCORE_PPO_VERL", "maybe")
    assert plugin.activate_from_environment() is False and not plugin.is_installed()
    assert "is not one of" in caplog.text
    monkeypatch.setenv("MCORE_PPO_VERL", "1")
    monkeypatch.setenv("MCORE_PPO_VERL_BACKEND", "fastest")
    with pytest.raises(ValueError, match="MCORE_PPO_VERL_BACKEND must be one of"):
        plugin.activate_from_environment()
    assert not plugin.is_installed()


def test_bad_precision_value_is_refused_naming_the_variable(fake_verl, monkeypatch):
    monkeypatch.setenv("MCORE_PPO_VERL", "1")
    monkeypatch.setenv("MCORE_PPO_VERL_PRECISION", "tf32")
    with pytest.raises(ValueError, match="MCORE_PPO_VERL_PRECISION must be one of auto, fp32_faithful, ieee"):
        plugin.activate_from_environment()
    assert not plugin.is_installed()


@pytest.mark.usefixtures("megatron_tp1")
@pytest.mark.parametrize("precision", ["auto", "fp32_faithful", "ieee", None])
def test_the_precision_variable_reaches_the_head(fake_verl, monkeypatch, precision):
    """``MCORE_PPO_VERL_PRECISION`` picks the precision of the backend verl's fused path runs
    on (a backend built with it; ``auto``: the plain name; unset with this fp32 weight:
    ``fp32_faithful``, an fp32 LM head's counterpart), and the values stay verl's."""
    import verl.models.mcore.model_forward_fused as fused

    from mcore_ppo.backends import backend_precision
    from mcore_ppo.integrations.verl import kernel as plugin_kernel

    seen = []
    real = plugin_kernel.linear_cross_entropy

    def spy(*args, backend, **kwargs):
        seen.append(backend)
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(plugin_kernel, "linear_cross_entropy", spy)
    monkeypatch.setenv("MCORE_PPO_VERL_BACKEND", "torch")
    if precision is not None:
        monkeypatch.setenv("MCORE_PPO_VERL_PRECISION", precision)
    plugin.install()
    gen = torch.Generator().manual_seed(12)
    hidden = torch.randn(10, 1, 16, generator=gen)
    weight = torch.randn(30, 16, generator=gen)
    labels = torch.randint(0, 30, (1, 10), generator=gen)
    out = fused.fused_output_processor(
        hidden_states=hidden, output_layer=type("Layer", (), {"weight": weight})(), output_weight=None,
        labels=labels, context=fused.FusedOutputProcessorContext(temperature=1.0),
        config=type("Config", (), {"sequence_parallel": False})(),
    )  # fmt: skip
    assert len(seen) == 1
    if precision == "auto":
        assert seen[0] == "torch"
    else:
        assert backend_precision(seen[0]) == (precision or "fp32_faithful") and seen[0].name == "torch"
    expected = torch.log_softmax(hidden[:, 0].double() @ weight.double().t(), -1).gather(1, labels[0, :, None])[:, 0]
    torch.testing.assert_close(out.log_probs.double().reshape(-1), expected, rtol=1e-5, atol=1e-6)


def test_two_import_hooks_on_one_module_both_run(tmp_path, monkeypatch):
    """The plugin's hook beside another watching the same verl module (a harness, a second
    integration): each asks the other finders, so before the guard each asked the other again
    without end (RecursionError in ``import verl.workers.engine.megatron...`` in verl's trainer)."""
    from mcore_ppo.integrations.import_hook import AfterImportHook

    (tmp_path / "hooked_twice.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []
    first = AfterImportHook({"hooked_twice"}, lambda module: seen.append("first"))
    second = AfterImportHook({"hooked_twice"}, lambda module: seen.append("second"))
    first.install()
    second.install()
    try:
        import hooked_twice  # noqa: F401

        assert sorted(seen) == ["first", "second"]
    finally:
        second.remove()
        first.remove()
        sys.modules.pop("hooked_twice", None)
