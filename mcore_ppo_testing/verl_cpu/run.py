"""Run ``python -m verl.trainer.main_ppo`` (verl's own trainer, unmodified) on the CPU, and read it back.

One :class:`RunConfig` is one trainer run: GRPO with verl's Megatron actor (bf16, TP 1 or TP 2
with sequence parallelism on gloo), the hybrid engine with verl's async agent loop, reward loop
and naive weight sync, and the ``hf_cpu`` rollout of :mod:`mcore_ppo_testing.verl_cpu.rollout`.
The plugin is switched as a user switches it: ``MCORE_PPO_VERL`` in the workers' environment and
``actor_rollout_ref.model.use_fused_kernels``. :func:`trainer_command` is the exact command line;
:func:`run_main_ppo` runs it in a fresh process group with its own Ray session (a temporary
folder, ``num_cpus``/``num_gpus`` declared, no dashboard) under a timeout, and returns a
:class:`RunResult`: verl's per-step metrics (its ``file`` logger), each step's log-probs and
the head's pass counts per process (:mod:`.records`), and the log.

``python -m mcore_ppo_testing.verl_cpu.run --tp 2 --plugin on --out DIR`` runs one from a shell.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mcore_ppo_testing.verl_cpu.assets import RunAssets, make_assets
from mcore_ppo_testing.verl_cpu.records import RECORD_DIR, read_head_calls
from mcore_ppo_testing.verl_cpu.rollout import ROLLOUT_NAME

__all__ = ["RunConfig", "RunResult", "load_result", "run_main_ppo", "trainer_command", "trainer_environment"]

REPO_ROOT = Path(__file__).resolve().parents[2]
# Megatron's fusions need CUDA kernels; with TransformerEngine absent the local spec is built.
CPU_TRANSFORMER_OVERRIDES = {
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    "gradient_accumulation_fusion": False,
    "use_cpu_initialization": True,
}


VARIANTS = ("grpo", "sum_pi", "distill")


@dataclass(frozen=True)
class RunConfig:
    """One ``main_ppo`` run. ``plugin``: ``"on"`` (``MCORE_PPO_VERL=1`` and verl's fused path),
    ``"off"`` (neither), ``"inert"`` (``MCORE_PPO_VERL=1``, ``use_fused_kernels=False``).
    ``variant``: ``"grpo"``; ``"sum_pi"`` (verl's optimal-token-baseline estimator, which needs
    ``calculate_sum_pi_squared``); ``"distill"`` (top-k distillation, ``forward_kl_topk`` with
    ``topk`` teacher ids from an ``hf_cpu`` teacher, beside GRPO's task reward)."""

    plugin: str = "on"
    tp: int = 1
    variant: str = "grpo"
    topk: int = 8
    tag: str = ""
    steps: int = 2
    seed: int = 1234
    prompts: int = 8
    batch_size: int = 4
    rollout_n: int = 4
    mini_batch_size: int = 2
    micro_batch_size: int = 4
    max_prompt_length: int = 40
    max_response_length: int = 16
    temperature: float = 1.0
    lr: float = 1e-4
    entropy_coeff: float = 0.01
    extra: tuple[str, ...] = ()
    timeout_s: float = 600.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.plugin not in ("on", "off", "inert"):
            raise ValueError(f"plugin must be 'on', 'off' or 'inert', got {self.plugin!r}")
        if self.tp not in (1, 2):
            raise ValueError(f"tp must be 1 or 2 (TP 2 runs sequence parallelism), got {self.tp}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")

    @property
    def label(self) -> str:
        variant = "" if self.variant == "grpo" else f"-{self.variant}"
        return f"tp{self.tp}{'+sp' if self.tp > 1 else ''}{variant}-{self.plugin}{self.tag}"

    @property
    def gpus(self) -> int:
        """Ray's logical GPUs: the actor's ranks, and one for a distillation teacher."""
        return self.tp + (self.variant == "distill")


#: Ray's message when its node's raylet did not register in time (nothing of verl ran yet), and how
#: many times such a run is started again.
RAY_START_TIMEOUT = "The current node timed out during startup"
RAY_START_RETRIES = 1


@dataclass
class RunResult:
    """What a run left: verl's metrics per step, each step's log-probs, the head's pass counts."""

    config: RunConfig
    returncode: int
    wall_s: float
    metrics: dict[int, dict[str, Any]]
    log_probs: dict[int, dict[str, torch.Tensor]]
    head_calls: list[dict[str, int]]
    log: str
    leftover: list[int] = field(default_factory=list)

    def tail(self, lines: int = 80) -> str:
        """The log's last lines (for a failure's message)."""
        return "\n".join(self.log.splitlines()[-lines:])


def _variant_overrides(config: RunConfig, assets: RunAssets) -> list[str]:
    if config.variant == "sum_pi":
        return [
            "algorithm.adv_estimator=optimal_token_baseline",
            "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
        ]
    if config.variant == "distill":
        teacher = "distillation.teacher_models.teacher_model"
        return [
            "algorithm.adv_estimator=grpo",
            "distillation.enabled=True",
            "distillation.distillation_loss.loss_mode=forward_kl_topk",
            f"distillation.distillation_loss.topk={config.topk}",
            "distillation.n_gpus_per_node=1",
            "distillation.nnodes=1",
            f"{teacher}.model_path={assets.teacher}",
            f"{teacher}.num_replicas=1",
            f"{teacher}.inference.tensor_model_parallel_size=1",
            # verl's distillation takes vLLM and SGLang teachers only; the harness serves
            # "sglang" with hf_cpu where SGLang is not installed.
            f"{teacher}.inference.name=sglang",
        ]
    return ["algorithm.adv_estimator=grpo"]


def trainer_command(config: RunConfig, assets: RunAssets, ray_dir: Path) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with the overrides of ``config`` (Hydra syntax)."""
    tp = config.tp
    fused = config.plugin == "on"
    overrides = [
        *_variant_overrides(config, assets),
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={assets.train_files}",
        f"data.val_files={assets.train_files}",
        f"data.train_batch_size={config.batch_size}",
        f"data.max_prompt_length={config.max_prompt_length}",
        f"data.max_response_length={config.max_response_length}",
        "data.dataloader_num_workers=0",
        f"data.seed={config.seed}",
        f"actor_rollout_ref.model.path={assets.model}",
        f"actor_rollout_ref.model.tokenizer_path={assets.tokenizer}",
        f"actor_rollout_ref.model.use_fused_kernels={fused}",
        "actor_rollout_ref.actor.strategy=megatron",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.sequence_parallel={tp > 1}",
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
        f"actor_rollout_ref.actor.megatron.seed={config.seed}",
        *(
            f"+actor_rollout_ref.actor.megatron.override_transformer_config.{k}={v}"
            for k, v in CPU_TRANSFORMER_OVERRIDES.items()
        ),
        f"actor_rollout_ref.actor.ppo_mini_batch_size={config.mini_batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={config.micro_batch_size}",
        f"actor_rollout_ref.actor.entropy_coeff={config.entropy_coeff}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        f"actor_rollout_ref.actor.optim.lr={config.lr}",
        "actor_rollout_ref.actor.use_torch_compile=False",
        f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}",
        f"actor_rollout_ref.rollout.n={config.rollout_n}",
        f"actor_rollout_ref.rollout.temperature={config.temperature}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={config.micro_batch_size}",
        "actor_rollout_ref.rollout.full_determinism=True",
        f"actor_rollout_ref.rollout.seed={config.seed}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={assets.reward}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.use_v1=False",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={tp}",
        f"trainer.total_training_steps={config.steps}",
        "trainer.total_epochs=100",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=mcore_ppo",
        f"trainer.experiment_name={config.label}",
        "ray_kwargs.ray_init.num_cpus=8",
        f"+ray_kwargs.ray_init.num_gpus={config.gpus}",
        "+ray_kwargs.ray_init.include_dashboard=False",
        f"+ray_kwargs.ray_init._temp_dir={ray_dir}",
        *config.extra,
    ]
    return [sys.executable, "-m", "verl.trainer.main_ppo", "--config-name", "ppo_megatron_trainer", *overrides]


def trainer_environment(config: RunConfig, record_dir: Path) -> dict[str, str]:
    """The run's environment: the CPU platform and rollout as verl's external module, the plugin switch."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        VERL_USE_EXTERNAL_MODULES="mcore_ppo_testing.verl_cpu.external",
        VERL_PLATFORM="cpu",
        # verl registers its Megatron engine for CUDA devices; the CPU platform runs that one.
        VERL_ENGINE_DEVICE="cuda",
        VERL_ENGINE_VENDOR="nvidia",
        VERL_FILE_LOGGER_PATH=str(record_dir / "metrics.jsonl"),
        MCORE_PPO_VERL="0" if config.plugin == "off" else "1",
        MCORE_PPO_LOG_LEVEL="INFO",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONHASHSEED=str(config.seed),
        RAY_DEDUP_LOGS="0",
        RAY_USAGE_STATS_ENABLED="0",
        HYDRA_FULL_ERROR="1",
        **{RECORD_DIR: str(record_dir)},
    )
    env.update(config.env)
    return env


def _read_metrics(path: Path) -> dict[int, dict[str, Any]]:
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["step"]: row["data"] for row in rows}


def run_main_ppo(config: RunConfig, workdir: Path, assets: RunAssets | None = None) -> RunResult:
    """Run verl's trainer for ``config`` under ``workdir`` (assets made there unless given)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if assets is None:
        assets = make_assets(workdir / "assets", seed=config.seed, prompts=config.prompts)
    record_dir = workdir / config.label
    record_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    for attempt in range(1 + RAY_START_RETRIES):
        returncode, leftover = _run_once(config, assets, record_dir)
        log = (record_dir / "main_ppo.log").read_text(errors="replace")
        # Ray's node gives its raylet 30 s to register (hard-coded in ray/_private/node.py), which
        # two saturated cores can exceed before verl has run anything: only that is run again.
        if returncode == 0 or RAY_START_TIMEOUT not in log or (record_dir / "metrics.jsonl").exists():
            break
        print(f"{config.label}: Ray's node did not start in time (attempt {attempt + 1}); running again", flush=True)
    return load_result(config, workdir, returncode=returncode, wall_s=time.monotonic() - start, leftover=leftover)


def _run_once(config: RunConfig, assets: RunAssets, record_dir: Path) -> tuple[int, list[int]]:
    """One run of verl's trainer: its exit status and any process of it left behind."""
    ray_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
    command = trainer_command(config, assets, ray_dir)
    with open(record_dir / "main_ppo.log", "wb") as log:
        process = subprocess.Popen(
            command, cwd=record_dir, env=trainer_environment(config, record_dir), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            returncode = process.wait(timeout=config.timeout_s)
        except subprocess.TimeoutExpired:
            returncode = -signal.SIGKILL
        finally:
            leftover = _end_session(process, ray_dir)
    return returncode, leftover


def load_result(
    config: RunConfig, workdir: Path, *, returncode: int = 0, wall_s: float = 0.0, leftover: list[int] | None = None
) -> RunResult:
    """The :class:`RunResult` of ``config``'s run from what it left under ``workdir``."""
    record_dir = workdir / config.label
    log_probs = {
        int(path.stem.split("step")[-1]): torch.load(path) for path in sorted(record_dir.glob("old_log_probs.step*.pt"))
    }
    return RunResult(
        config=config,
        returncode=returncode,
        wall_s=wall_s,
        metrics=_read_metrics(record_dir / "metrics.jsonl"),
        log_probs=log_probs,
        head_calls=read_head_calls(record_dir),
        log=(record_dir / "main_ppo.log").read_text(errors="replace"),
        leftover=leftover or [],
    )


def _end_session(process: subprocess.Popen, ray_dir: Path) -> list[int]:
    """Kill what the run left: its process group, and Ray's processes of its session; returns
    the ids of any process of the session still there a few seconds later (none expected)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(1.0 if sig == signal.SIGTERM else 0)
    process.wait()
    # Ray's raylet and GCS start their own sessions; find them by the session folder they hold.
    for pid in _pids_using(ray_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(50):
        left = _pids_using(ray_dir)
        if not left:
            break
        time.sleep(0.1)
    shutil.rmtree(ray_dir, ignore_errors=True)
    return left


def _pids_using(folder: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(folder) in cmdline:
            found.append(int(proc.name))
    return found


def main(argv: list[str] | None = None) -> int:
    """Run one configuration from the shell and print its metrics per step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--plugin", default="on", choices=("on", "off", "inert"))
    parser.add_argument("--variant", default="grpo", choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for main_ppo")
    args = parser.parse_args(argv)
    config = RunConfig(
        plugin=args.plugin, tp=args.tp, variant=args.variant, steps=args.steps, seed=args.seed, extra=tuple(args.extra)
    )
    out = args.out or Path(tempfile.mkdtemp(prefix="verl_main_ppo_"))
    result = run_main_ppo(config, out)
    print(result.tail(40))
    print(f"{config.label}: exit {result.returncode}, {result.wall_s:.0f} s, records in {out}")
    for step, metrics in sorted(result.metrics.items()):
        keys = ("actor/grad_norm", "actor/entropy", "actor/pg_loss", "actor/ppo_kl")
        print(step, {key: metrics.get(key) for key in keys})
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
