"""The head's core imports and runs without megatron-core.

A fresh interpreter gets a ``sys.meta_path`` finder that refuses ``megatron`` and every
``megatron.*`` module, as in an environment where megatron-core is not installed. It imports
the kernels, the backends, the autograd Function, the head's call path, parallel's combine and groups,
and the package itself; runs a small torch-backend forward and backward on the CPU through the
public API, then the head and the teacher's top-k again with a one-rank ``torch.distributed``
group initialised (no Megatron groups to ask: one rank); and checks that no Megatron module was
loaded. The Megatron integration (the head
module) must fail there with an ImportError that names Megatron, not with anything else.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mcore_ppo

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class NoMegatron(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "megatron" or name.startswith("megatron."):
                raise ImportError(f"No module named {name!r} (blocked: megatron-core is not installed)")
            return None


    sys.meta_path.insert(0, NoMegatron())

    import torch

    import mcore_ppo
    import mcore_ppo.backends
    import mcore_ppo.ops
    import mcore_ppo.shard
    import mcore_ppo.kernels
    import mcore_ppo.head_call
    import mcore_ppo.liger
    import mcore_ppo.parallel.combine
    import mcore_ppo.parallel.groups
    from mcore_ppo.backends.torch_backend import TorchBackend
    from mcore_ppo.ops import HeadCall, head
    from mcore_ppo.options import HiddenGrad, WeightGrad
    from mcore_ppo.statistics import DEFAULT

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (3, 4), generator=gen)
    labels[0, 0] = -100
    log_probs, entropy = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend="torch")
    (log_probs.sum() + entropy.sum()).backward()
    assert log_probs.shape == (3, 4) and hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape

    # The same numbers straight through the head's op, and against the full logits.
    backend = TorchBackend()  # held: the op finds it by its key while it lives
    call = HeadCall(backend.op_key, "", HiddenGrad.PARTIAL, WeightGrad.GRAD, -100, 0, 11, 0.7, DEFAULT, False)
    flat_lp, _, _ = head(hidden.detach().reshape(-1, 8), weight.detach(), labels.t().reshape(-1), None, None, call)
    torch.testing.assert_close(flat_lp.view(4, 3).t(), log_probs.detach())
    full = torch.log_softmax(hidden.detach().transpose(0, 1) @ weight.detach().t() / 0.7, dim=-1)
    expected = full.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1).masked_fill(labels == -100, 0.0)
    torch.testing.assert_close(log_probs.detach(), expected)

    # With torch.distributed initialised (FSDP, a trainer of its own) and no Megatron: one rank,
    # for the head and the teacher's top-k alike.
    import socket

    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        again, _ = mcore_ppo.fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend="torch")
        torch.testing.assert_close(again, log_probs)
        top = mcore_ppo.fused_topk(hidden.detach().reshape(-1, 8), weight.detach(), 3, impl="torch")
        assert top.ids.shape == (12, 3)
    finally:
        dist.destroy_process_group()

    loaded = sorted(name for name in sys.modules if name == "megatron" or name.startswith("megatron."))
    assert not loaded, loaded
    try:
        mcore_ppo.VocabParallelFusedPPOHead
    except ImportError as err:
        assert "megatron" in str(err), err
    else:
        raise AssertionError("the head module imported without megatron-core")
    print("ok")
    """
)


def test_core_runs_without_megatron():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)  # the kernels must import as they would on a GPU machine
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("ok")


def test_lazy_exports_resolve():
    """Every public name of the package is listed once and resolves to its module's object."""
    assert sorted(mcore_ppo.__all__) == sorted(mcore_ppo._EXPORTS)
    for name, module in mcore_ppo._EXPORTS.items():
        assert getattr(mcore_ppo, name) is getattr(__import__(module, fromlist=[name]), name)
    assert set(mcore_ppo.__all__) <= set(dir(mcore_ppo))
