"""The README's main command: ``scripts/launch.sh`` runs PPO steps under TP 2 + SP × CP 2 (and
TP 1 × CP 2 × PP 2) and proves parity; a parity failure exits non-zero (subprocess tests;
torchrun inside)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # bash + a Python start-up per case; torchrun runs for the demo's

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch.sh"
CONFIG = ROOT / "configs" / "ppo_demo.yaml"
TIMEOUT = int(os.environ.get("MCORE_PPO_LAUNCH_TEST_TIMEOUT", "600"))


# The GPU count of launch.sh's pre-flight (scripts/launch_preflight.py), faked: torch.cuda says
# there are N GPUs, then the real pre-flight runs.
_FAKE_GPUS = """
import runpy, sys, torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: {count}
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(*args: str, visible_gpus: int | None = None, tmp_path: Path | None = None) -> subprocess.CompletedProcess:
    """``scripts/launch.sh args`` with this interpreter's ``python`` and ``torchrun``; no GPU visible,
    or with ``visible_gpus`` (and a ``tmp_path`` for the shim): a ``python`` shim runs launch.sh's
    pre-flight with torch.cuda answering that count, and everything else with the real interpreter."""
    env = dict(
        os.environ,
        MCORE_PPO_LAUNCH_TIMEOUT=str(TIMEOUT - 30),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    env.pop("WORLD_SIZE", None)  # never inherit an enclosing torchrun's rendezvous
    if visible_gpus is None:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPUs, gloo, whatever GPUs are here
    else:
        assert tmp_path is not None
        shim = tmp_path / "bin" / "python"
        shim.parent.mkdir()
        fake = tmp_path / "fake_gpus.py"
        fake.write_text(_FAKE_GPUS.format(count=visible_gpus))
        shim.write_text(
            "#!/usr/bin/env bash\n"
            f'case "$*" in *launch_preflight.py*) exec "{sys.executable}" "{fake}" "$@" ;; '
            f'*) exec "{sys.executable}" "$@" ;; esac\n'
        )
        shim.chmod(0o755)
        env["PATH"] = f"{shim.parent}:{env['PATH']}"
        env.pop("CUDA_VISIBLE_DEVICES", None)  # the shim, not the host, says how many GPUs there are
    return subprocess.run(
        ["bash", str(LAUNCH), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT
    )


def _check_parity_lines(out: str, *, steps: int) -> None:
    """Every step's parity line (head vs the fp64 logits path, CP2 vs cp1) and the parameters'
    line within the config's tolerances."""
    tol = yaml.safe_load(CONFIG.read_text())["run"]["tolerance"]
    parity = re.findall(
        rf"step (\d)/{steps} parity \| head vs fp64 full-logits path \((\d+) response tokens\): "
        r"max\|Δlog_prob\| (\S+), max\|Δentropy\| (\S+) \| CP2 vs cp1: max\|Δlog_prob\| ([^ ]+)",
        out,
    )
    assert [p[0] for p in parity] == [str(step) for step in range(1, steps + 1)], out
    for _, tokens, d_lp, d_ent, d_cp in parity:
        assert int(tokens) > 0
        assert 0.0 <= float(d_lp) <= tol["log_prob"]
        assert 0.0 <= float(d_ent) <= tol["entropy"]
        assert 0.0 <= float(d_cp) <= tol["log_prob"]
    params = re.findall(rf"after {steps} step\(s\): CP2 vs cp1 max\|Δparameter\| (\S+) ", out)
    assert len(params) == 1 and 0.0 <= float(params[0]) <= tol["params"], out


def test_main_command_passes_with_parity_lines(tmp_path):
    """Default layout (TP 2 + SP, CP 2 inside the model, 4 ranks), 2 steps to keep CI short, on a
    machine that shows 1 GPU: launch.sh says the 4 ranks run on the CPUs (gloo) instead of failing
    on a missing device, and runs them there (the GPU count is faked, see :func:`_run`; with no
    GPU at all, the same run without the notice: test_parity_failure_exits_nonzero)."""
    proc = _run("--steps", "2", visible_gpus=1, tmp_path=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, f"launch.sh exited {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert out.splitlines()[0].startswith("launch: 4 ranks, TP 2 × CP 2 (in the model) × PP 1, SP on: "), out
    assert "4 ranks need 4 GPUs, 1 visible: running on the CPUs with gloo" in out, out
    assert "(CPU, gloo)" in out, out
    assert "layout TP2+SP × CP2" in out, out
    _check_parity_lines(out, steps=2)
    updates = re.findall(r"step \d/2 update \d/2 \| loss (\S+) .*\| kl\(old\|\|new\) (\S+) \| entropy (\S+)", out)
    assert len(updates) == 4, out
    assert all(float(kl) >= 0.0 for _, kl, _ in updates)
    assert float(updates[1][1]) > 0.0  # the second update of a rollout sees a moved policy
    last = out.strip().splitlines()[-1]
    assert last.startswith("PASS: head log-probs == fp64 full-logits path"), last
    assert "CP2 (in the model) == cp1" in last and "TP2+SP" in last, last


def test_context_and_pipeline_parallel_together():
    """TP 1 × CP 2 inside the model × PP 2 (4 ranks), one step: the pipeline stages exchange the
    CP-local activations Megatron's schedule expects, and the parity holds as in the default
    layout (head vs the fp64 logits path, CP2 vs the same steps without CP)."""
    proc = _run("--tp", "1", "--cp", "2", "--pp", "2", "--steps", "1")
    out = proc.stdout
    assert proc.returncode == 0, f"launch.sh exited {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "4 ranks (CPU, gloo), layout TP1 × CP2 (inside the model" in out and "× PP2" in out, out
    _check_parity_lines(out, steps=1)
    last = out.strip().splitlines()[-1]
    assert last.startswith("PASS: head log-probs == fp64 full-logits path"), last
    assert "× PP2, over 1 step(s)" in last and "CP2 (in the model) == cp1" in last, last


def test_parity_failure_exits_nonzero(tmp_path):
    """One rank, TP 1: with a zero tolerance the parity check must fail, say so, and exit 1."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["run"]["tolerance"] = {"log_prob": 0.0, "entropy": 0.0, "params": 0.0}
    cfg["rollout"]["num_seqs"] = 4
    cfg["ppo"]["ppo_epochs"] = 1
    path = tmp_path / "strict.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = _run("--config", str(path), "--tp", "1", "--cp", "1", "--steps", "1")
    out = proc.stdout
    assert proc.returncode == 1, f"expected exit 1, got {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "running on the CPUs" not in out, out  # no GPU visible: the CPUs, without a notice
    assert out.strip().splitlines()[-1].startswith("FAIL: head log-probs differ from the logits path"), out


def _without_torch(tmp_path: Path, **env: str) -> dict[str, str]:
    """This environment with an ``import torch`` that fails: what needs no torch must run with it."""
    blocker = tmp_path / "no_torch" / "torch"
    blocker.mkdir(parents=True, exist_ok=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch imported where no torch is needed')\n")
    path = os.pathsep.join(filter(None, [str(blocker.parent), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **env)


def _refused(tmp_path: Path, *args: str) -> str:
    """launch.sh's one-line refusal of ``args``: exit 2 before torchrun, nothing else printed, and
    no torch imported (a refusal is a Python start-up and a YAML read: ``import torch`` fails here)."""
    env = _without_torch(tmp_path)
    proc = subprocess.run(["bash", str(LAUNCH), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.sh: "), proc.stderr
    return lines[0]


# Each code path of launch.sh's pre-flight check once, end to end: its own checks (before and
# after the config check), and the config check's refusals it relays (a size against the model, an
# override in both spellings, an argparse error, a bad config file). Every other refusal of the
# config check is test_preflight_refuses_in_one_line: the same check, in this process.
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tp", "x"], "--tp must be a positive integer, got 'x'"),
        (["--tp", "0"], "--tp must be >= 1, got 0"),
        (["--config", "/nonexistent.yaml"], "no config file /nonexistent.yaml"),
        (["--tp", "2", "--cp", "2", "--nproc", "3"], "--nproc 3 is not a multiple of tp*cp*pp = 4"),
        (["--tp", "3"], "model.vocab_size = 512 does not divide by --tp 3"),
        (["--pp", "3"], "model.num_layers = 2 does not divide by --pp 3"),
        (["--backend=bogus"], "head.backend must be one of auto, torch, triton, got 'bogus'"),
        (["--steps", "x"], "--steps: invalid int value: 'x'"),
        (["--frobnicate"], "unknown option '--frobnicate'"),
        (["--steps", "1", "extra"], "unknown option 'extra'"),
        (["--tp"], "--tp needs a value"),
        (["--tp", "1", "--sp"], "--sp needs --tp > 1"),
    ],
)
def test_launch_refuses_bad_arguments_in_one_line(tmp_path, args, says):
    assert says in _refused(tmp_path, *args)


def _bad_config(tmp_path: Path, section: str, key: str, value) -> Path:
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg[section][key] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_launch_rejects_a_bad_config_before_torchrun(tmp_path):
    """The config is checked once, by the demo's loader, before any rank starts: exit 2, key named."""
    assert "ppo.clip_ratoi" in _refused(tmp_path, "--config", str(_bad_config(tmp_path, "ppo", "clip_ratoi", 0.2)))


@pytest.mark.parametrize(
    ("args", "config", "says"),
    [
        (["--tp", "8", "--cp", "1"], None, "model.num_attention_heads = 4 does not divide by --tp 8"),
        (["--backend", "bogus"], None, "head.backend must be one of auto, torch, triton, got 'bogus'"),
        (["--cp-mode", "both"], None, "--cp-mode: invalid choice: 'both'"),
        ([], ("layout", "tp", "two"), "layout.tp"),
        ([], ("run", "steps", 1.5), "run.steps"),
    ],
)
def test_preflight_refuses_in_one_line(tmp_path, capsys, args, config, says):
    """launch.sh's config check (``python -m mcore_ppo_testing.demo_config CONFIG --layout [sizes]
    [overrides]``, as launch.sh builds it) refuses with exit 2 and one line, which launch.sh shows
    without the ``demo_config: `` prefix."""
    from mcore_ppo_testing.demo_config import main

    path = _bad_config(tmp_path, *config) if config else CONFIG
    try:
        status = main([str(path), "--layout", *args])
    except SystemExit as stop:  # argparse's refusal
        status = stop.code
    captured = capsys.readouterr()
    assert status == 2 and captured.out == "", captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo_config: "), captured.err
    assert says in lines[0].removeprefix("demo_config: ")


def _preflight(tmp_path: Path, *args: str) -> list[str]:
    """launch.sh's pre-flight on the demo config (``--nproc`` first when given, as launch.sh
    passes it), without torch: its two lines."""
    nproc = list(args[:2]) if args[:1] == ("--nproc",) else []
    preflight = str(ROOT / "scripts" / "launch_preflight.py")
    proc = subprocess.run(
        [sys.executable, preflight, *nproc, "configs/ppo_demo.yaml", *args[len(nproc) :]],
        cwd=ROOT,
        env=_without_torch(tmp_path, CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout.splitlines()


def test_preflight_passes_without_torch_when_no_gpu_can_be_visible(tmp_path):
    """The pre-flight's answer (``tp cp pp nproc gpus``, then launch.sh's first line) on a good
    config: with CUDA_VISIBLE_DEVICES empty it needs no torch for the GPU count either."""
    for args, line in (((), "2 2 1 4 0"), (("--nproc", "8", "--tp", "1", "--cp", "2"), "1 2 1 8 0")):
        lines = _preflight(tmp_path, *args)
        assert len(lines) == 2 and lines[0] == line and lines[1].startswith("launch: "), lines


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "launch: 4 ranks, TP 2 × CP 2 (in the model) × PP 1, SP on: TP, CP, PP and SP from configs/ppo_demo.yaml"),
        (("--tp", "2"), "launch: 2 ranks, TP 2 × CP 1 × PP 1, SP on: TP from --tp; CP 1, PP 1 (not given: sizes on "
         "the command line set the whole layout, the config's CP 2 not used); SP from configs/ppo_demo.yaml"),
        (("--pp", "2"), "launch: 2 ranks, TP 1 × CP 1 × PP 2, SP off: PP from --pp; TP 1, CP 1 (not given: sizes on "
         "the command line set the whole layout, the config's TP 2 and CP 2 not used); SP off (TP 1)"),
        (("--nproc", "8", "--tp", "4", "--cp", "1", "--no-sp"), "launch: 8 ranks (--nproc: 2 data-parallel "
         "replicas), TP 4 × CP 1 × PP 1, SP off: TP from --tp, CP from --cp; PP 1 (not given: sizes on the command "
         "line set the whole layout); SP from --no-sp"),
    ],
    ids=["config", "tp-alone", "pp-alone", "nproc-and-flags"],
)  # fmt: skip
def test_first_line_says_the_layout_and_where_it_came_from(tmp_path, args, says):
    """Sizes given set the whole layout (the others 1), and launch.sh's first line says so: the
    ranks, TP × CP × PP, SP, and for each whether a flag or the config set it."""
    assert _preflight(tmp_path, *args)[1] == says


def test_config_check_names_the_backends_of_the_registry():
    """demo_config repeats the backend names (so that it imports without torch): the same names."""
    from mcore_ppo.backends import BACKENDS
    from mcore_ppo_testing import demo_config

    assert demo_config._BACKENDS == BACKENDS


def test_help_shows_the_usage_only():
    proc = subprocess.run(["bash", str(LAUNCH), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("usage: scripts/launch.sh "), proc.stdout
    for option in ("--tp", "--cp", "--pp", "--nproc", "--config", "--timeout", "--sp", "--cp-mode", "--steps"):
        assert re.search(rf"^  .*{option}\b", proc.stdout, re.MULTILINE), option  # an option's line
    assert "set -euo" not in proc.stdout and "cd " not in proc.stdout, proc.stdout


def test_a_rank_without_its_gpu_is_refused_by_name(monkeypatch):
    """Started under torchrun by hand with more ranks than GPUs, a rank says which GPU it lacks."""
    from mcore_ppo_testing import ppo_harness

    monkeypatch.setattr(ppo_harness.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ppo_harness.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK 3 needs GPU 3, but 1 are visible"):
        ppo_harness.init_distributed()
