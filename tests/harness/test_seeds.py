"""The tests' seeds are reproducible: a fixed default, overridable, restarted per test, printed."""

from __future__ import annotations

import pytest

from mcore_ppo_testing import seeds


def test_sequence_starts_at_the_default(monkeypatch, capsys):
    monkeypatch.delenv(seeds.ENV_VAR, raising=False)
    assert [seeds.next_seed() for _ in range(3)] == [seeds.DEFAULT_SEED + i for i in range(3)]
    assert f"seed={seeds.DEFAULT_SEED} ({seeds.ENV_VAR}={seeds.DEFAULT_SEED})" in capsys.readouterr().out


def test_environment_overrides_and_each_test_restarts(monkeypatch):
    monkeypatch.setenv(seeds.ENV_VAR, "77")
    assert seeds.next_seed() == 77  # the conftest fixture restarted the sequence for this test
    seeds.start_test()
    assert seeds.next_seed() == 77 and seeds.next_seed() == 78


def test_bad_environment_value(monkeypatch):
    monkeypatch.setenv(seeds.ENV_VAR, "seven")
    with pytest.raises(ValueError, match="MCORE_PPO_TEST_SEED must be an integer"):
        seeds.next_seed()
