"""The GPU benchmarks' shared helpers that run without a GPU: report merging and tables, the
backend configs the tuner and sweeps pass as objects (no module state is changed), Liger's
scaled CE through the Liger entry point."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mcore_ppo_testing import bench


def _report(shape: str) -> dict:
    impl = {"fwd_ms": 2.0, "nograd_fwd_ms": 1.5, "fwd_bwd_ms": 8.0, "fwd_ratio": 1.05, "fwd_bwd_ratio": 1.02}
    impl.update(peak_extra_gib=1.5, logp_rel_err=2e-6, entropy_rel_err=3e-6, dhidden_rel_err=None)
    floor = {"gemm1_ms": 1.9, "gemm3_ms": 5.9, "gemm4_ms": 7.8}
    entry = {"shape": shape, "tp": 1, "hidden": 8, "vocab_local": 16, "tokens": 4, "temperature": 0.7}
    entry.update(output_grads_gib=1.0, floor=floor, impls={"ours_triton": impl, "verl_linear_ce": {"skipped": "no"}})
    return {"device": "test", "date": "today", "args": {}, "results": [entry]}


def test_merge_reports_writes_one_report_and_table(tmp_path, capsys):
    paths = []
    for shape in ("qwen7b", "llama3-8b"):
        paths.append(tmp_path / f"{shape}.json")
        paths[-1].write_text(json.dumps(_report(shape)))
    assert bench.merge_reports([str(p) for p in paths], tmp_path / "out", "merged") == 0
    merged = json.loads((tmp_path / "out" / "merged.json").read_text())
    assert [r["shape"] for r in merged["results"]] == ["qwen7b", "llama3-8b"] and len(merged["runs"]) == 2
    table = (tmp_path / "out" / "merged_table.md").read_text().splitlines()
    assert len(table) == 4 and "| qwen7b | 1 | 16 |" in table[2] and table[2].endswith("| - |")
    assert "ours_triton" in capsys.readouterr().out


def test_build_impls_configures_our_backends_by_object(monkeypatch):
    """One TritonConfig reaches every ``ours_triton*`` backend (the recompute and buffer variants
    change its budget only); Liger's scaled CE runs through the Liger entry point."""
    pytest.importorskip("mcore_ppo.backends.triton_backend")
    import torch

    from mcore_ppo import liger
    from mcore_ppo.backends.triton_config import GPU_FORWARD, TritonConfig

    config = TritonConfig(forward_config=replace(GPU_FORWARD, group_m=8), workspace_bytes=1 << 20)
    impls = bench.build_impls(config)
    assert impls["ours_triton"][2]["forward_config"]["group_m"] == 8
    assert list(impls)[:4] == ["ours_triton", "ours_triton_recompute", "ours_triton_buffer", "ours_torch"]
    backends = {name: impls[name][0].backend for name in ("ours_triton", "ours_triton_recompute", "ours_triton_buffer")}
    assert backends["ours_triton"].config is config
    for name, budget in (("ours_triton_recompute", 0), ("ours_triton_buffer", 1 << 40)):
        assert backends[name].config == replace(config, buffer_budget_bytes=budget), name
    assert impls["ours_torch"][0].backend == "torch"
    assert bench.build_impls()["ours_triton"][0].backend.config == TritonConfig()
    assert bench.Timer(reps=3).flipped() == bench.Timer(reps=3, hide_host_latency=False)

    calls = []
    monkeypatch.setattr(liger, "liger_log_probs_and_entropy", lambda *a, **k: calls.append((a, k)) or ("logp", None))
    fn, skip, _ = impls["liger_scaled_ce"]
    assert skip is None or "not installed" in skip
    x, w, labels = torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.int64)
    assert fn(x, w, labels, 0.7) == ("logp", None)
    ((args, kwargs),) = calls
    assert args == (x, w, labels) and kwargs == {"temperature": 0.7, "validate": False}


def test_bench_head_refuses_an_unknown_shape_by_name(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_head.py"
    spec = importlib.util.spec_from_file_location("bench_head_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.parse_args(["--shapes", "qwen7b"]).shapes == "qwen7b"
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--shapes", "qwen7b,qwen99"])
    assert exit_info.value.code == 2
    assert f"unknown shape 'qwen99' in --shapes (known: {', '.join(bench.SHAPES)})" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sum_pi_squared_overhead_runs_on_cpu_at_a_tiny_shape(backend):
    """bench_head's Σπ² measurement (alternating order, medians, ratio, error against fp64) on CPU
    tensors: the torch backend, and the triton one in the interpreter; and its flag parses."""
    import torch

    from mcore_ppo_testing.bench_sum_pi import sum_pi_squared_overhead
    from mcore_ppo_testing.seeds import generator, next_seed

    if backend == "triton":
        from mcore_ppo.backends import import_optional

        if import_optional("triton") is None or not _interpreting():
            pytest.skip("the triton backend runs CPU tensors only in the interpreter")
    gen = generator(next_seed())
    x, w = torch.randn(12, 16, generator=gen), torch.randn(40, 16, generator=gen) / 4
    labels = torch.randint(0, 40, (12,), generator=gen)
    labels[::3] = -100
    res = sum_pi_squared_overhead(x, w, labels, 0.7, backend, rounds=3)
    assert res["rounds"] == 3 and res["sum_pi_squared_rel_err"] < 1e-5
    for mode in ("fwd", "nograd_fwd"):
        assert res[f"{mode}_ms"] > 0 and res[f"{mode}_sum_pi_squared_ms"] > 0 and res[f"{mode}_ratio"] > 0


def test_bench_head_records_sum_pi_squared_per_entry(monkeypatch):
    """The step bench_head runs after ``ours_triton`` (the GPU timer replaced by the wall clock)."""
    import torch

    from mcore_ppo_testing import bench_sum_pi

    monkeypatch.setattr(bench_sum_pi, "gpu_timer", lambda hide: bench_sum_pi.wall_ms)
    steps = []
    bar = type("Bar", (), {"update": lambda self, label: steps.append(label)})()
    inputs = bench.HeadInputs(torch.randn(6, 8), torch.randn(20, 8), torch.arange(6), torch.ones(6), torch.ones(6))
    entry = {"shape": "tiny", "tp": 1, "temperature": 0.7, "impls": {"ours_triton": {}}}
    bench_sum_pi.record_sum_pi_squared(entry, bench.ours("torch"), inputs, 2, bench.Timer(), bar)
    assert entry["sum_pi_squared"]["rounds"] == 2 and steps == ["tiny tp1 sum_pi_squared"]
    failed = {"shape": "tiny", "tp": 1, "temperature": 0.7, "impls": {"ours_triton": {"error": "x"}}}
    bench_sum_pi.record_sum_pi_squared(failed, bench.ours("torch"), inputs, 2, bench.Timer(), bar)
    assert "sum_pi_squared" not in failed


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def test_bench_head_parses_the_sum_pi_squared_rounds():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_head.py"
    spec = importlib.util.spec_from_file_location("bench_head_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.parse_args([]).sum_pi_squared_rounds == 10
    assert script.parse_args(["--sum-pi-squared-rounds", "0"]).sum_pi_squared_rounds == 0
