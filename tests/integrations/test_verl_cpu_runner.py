"""The runner of verl's own trainer (``mcore_ppo_testing.verl_cpu.run``) without verl: a run whose
Ray node did not start in time (two saturated cores can exceed Ray's hard-coded 30 s) is started
once more; any other failure, or one after verl wrote metrics, is reported as it is."""

from __future__ import annotations

import pytest

from mcore_ppo_testing.verl_cpu import run
from mcore_ppo_testing.verl_cpu.assets import RunAssets

RAY_FAILURE = f"Exception: {run.RAY_START_TIMEOUT}. This could happen because ...\n"


def _scripted(monkeypatch, outcomes: list[tuple[int, str, bool]]) -> list[int]:
    """``_run_once`` replaced by ``outcomes`` (exit status, log, metrics written), in order."""
    calls: list[int] = []

    def run_once(config, assets, record_dir):
        status, log, metrics = outcomes[len(calls)]
        calls.append(status)
        (record_dir / "main_ppo.log").write_text(log)
        if metrics:
            (record_dir / "metrics.jsonl").write_text("")
        return status, []

    monkeypatch.setattr(run, "_run_once", run_once)
    return calls


@pytest.mark.parametrize(
    ("outcomes", "runs", "status"),
    [
        ([(1, RAY_FAILURE, False), (0, "trained\n", True)], 2, 0),  # Ray late once: run again
        ([(1, RAY_FAILURE, False), (1, RAY_FAILURE, False)], 2, 1),  # late twice: the failure stands
        ([(1, "Traceback: a real error\n", False)], 1, 1),  # any other failure: not run again
        ([(1, RAY_FAILURE, True)], 1, 1),  # after verl wrote metrics: not run again
        ([(0, "trained\n", True)], 1, 0),
    ],
    ids=["ray-late-once", "ray-late-twice", "other-failure", "after-metrics", "ok"],
)
def test_only_a_ray_start_timeout_is_run_again(monkeypatch, tmp_path, outcomes, runs, status):
    calls = _scripted(monkeypatch, outcomes)
    assets = RunAssets(*(tmp_path / name for name in RunAssets.__dataclass_fields__))
    result = run.run_main_ppo(run.RunConfig(), tmp_path, assets)
    assert len(calls) == runs and result.returncode == status
