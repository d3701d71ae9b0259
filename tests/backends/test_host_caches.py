"""What the head's host side decides once and caches, and that errors of the real work propagate.

- The fp32-output GEMM capability (``out_dtype``) is a probe on tiny tensors, asked once; an
  error of the real product (out of memory above all, a ``RuntimeError`` subclass) is never
  taken for "no ``out_dtype``" and propagates: checked on CPU with the CUDA branch forced (a
  tensor that reports ``is_cuda``) and ``torch.mm`` / ``torch.addmm`` raising.
- Backends resolved by name are built once per (name, device type).
- The shard-size check's cache is keyed by the process group object (weakly), so a new group
  never inherits an old one's entry, as it could through a reused ``id()``.
"""

from __future__ import annotations

import gc
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist

from mcore_ppo import backends, verdict
from mcore_ppo.backends import (
    TorchBackend,
    backend_from_key,
    backend_key,
    clear_backend_cache,
    fp32_gemms,
    registry,
    resolve_backend,
)
from mcore_ppo_testing.bench import fp32_gemm_path


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that takes the CUDA branch of the fp32 products."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _as_cuda(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_ReportsCuda, t)


def _out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


@pytest.mark.parametrize("capability", [(True, True), (True, False), (False, False)], ids=["addmm", "mm", "none"])
def test_out_of_memory_of_the_real_product_propagates(monkeypatch, capability):
    monkeypatch.setattr(fp32_gemms, "fp32_output_gemms", lambda device_type="cuda": capability)
    monkeypatch.setattr(torch, "mm", _out_of_memory)
    monkeypatch.setattr(torch, "addmm", _out_of_memory)
    a = _as_cuda(torch.zeros(4, 3, dtype=torch.bfloat16))
    b = _as_cuda(torch.zeros(3, 2, dtype=torch.bfloat16))
    out = torch.zeros(4, 2)
    with pytest.raises(torch.OutOfMemoryError):
        fp32_gemms.addmm_fp32(out, a, b)
    with pytest.raises(torch.OutOfMemoryError):
        fp32_gemms.mm_fp32(a, b)


def test_capability_probe(monkeypatch):
    # This CPU build has no out_dtype products: the probe says so (NotImplementedError is caught).
    assert fp32_gemms.probe_out_dtype("cpu") == (False, False)
    assert fp32_gemms.fp32_output_gemms("cpu") == (False, False)
    # An out-of-memory error in the probe itself is not a "no".
    monkeypatch.setattr(torch, "mm", _out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        fp32_gemms.probe_out_dtype("cpu")
    # A capability found is used without trying anything else.
    monkeypatch.undo()
    calls = []

    def mm(a, b, *, out_dtype=None):
        calls.append(out_dtype)
        return torch.ones(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(fp32_gemms, "fp32_output_gemms", lambda device_type="cuda": (True, False))
    a = _as_cuda(torch.zeros(4, 3, dtype=torch.bfloat16))
    assert fp32_gemms.mm_fp32(a, a.t()).dtype == torch.float32 and calls == [torch.float32]
    assert fp32_gemm_path("cpu")["mm"] == "fp32 upcast + mm"


def test_named_backends_are_built_once():
    clear_backend_cache()
    cpu = torch.device("cpu")
    first = resolve_backend("torch", cpu)
    assert isinstance(first, TorchBackend)
    assert resolve_backend("torch", cpu) is first and resolve_backend("auto", cpu) is resolve_backend("auto", cpu)
    clear_backend_cache()
    assert resolve_backend("torch", cpu) is not first


def test_a_named_key_resolves_once_and_is_then_found_by_the_ops():
    """The ops' lookup of a name key (``backend_from_key``) resolves it the first time, as
    ``resolve_backend`` does, and finds that object afterwards without resolving; a cleared
    cache resolves anew; an object key nothing registered is refused by name."""
    clear_backend_cache()
    cpu = torch.device("cpu")
    key = backend_key("torch", cpu)
    first = backend_from_key(key)
    assert first is resolve_backend("torch", cpu) and registry.resolved(key) is first
    with patch.object(backends, "resolve_key", side_effect=AssertionError("resolved again")):
        assert backend_from_key(key) is first
    clear_backend_cache()
    assert registry.resolved(key) is None and backend_from_key(key) is not first
    with pytest.raises(ValueError, match="not registered"):
        backend_from_key("torch@dead")


def test_shared_signatures_are_keyed_by_the_group_object(gloo_world):
    """The signatures whose verdict a group shared (once each, over an accelerator's group) are
    kept per group object; a new group, even at a destroyed one's address, starts clean."""
    before = len(verdict._SHARED)
    group = dist.new_group([0])
    verdict._shared_signatures(group).add("signature")
    assert "signature" in verdict._shared_signatures(group)
    other = dist.new_group([0])
    assert verdict._shared_signatures(other) == set()
    # A destroyed group takes its entries with it: a later group, even one at the same address
    # (the id() reuse that an id-keyed cache would mistake for the old group), starts clean.
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert len(verdict._SHARED) == before + 1  # only ``other``'s
    fresh = dist.new_group([0])
    assert verdict._shared_signatures(fresh) == set()
