"""The actor's distillation option: its config keys, the per-micro-batch teacher packing and loss,
the teacher's top-k through both forward routes (the ``output_processor`` hook and the
``post_process`` one) against each other and the teacher's fp64 full logits (a multi-token
prediction teacher: the hook route; the other refuses it) (single process), and
the demo (``scripts/launch.sh --config configs/distill_demo.yaml``: TP 2 + SP × CP 2 on 4 CPU
ranks, one short step; its parity lines and PASS verdict)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mcore_ppo.actor import PPOActorConfig
from mcore_ppo_testing.demo_config import load_demo_config
from mcore_ppo_testing.seeds import generator, next_seed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "distill_demo.yaml"
TIMEOUT = int(os.environ.get("MCORE_PPO_LAUNCH_TEST_TIMEOUT", "600"))


def test_shipped_config_loads_typed():
    config = load_demo_config(CONFIG)
    actor = config.ppo.actor
    assert actor.distill and actor.distill_coeff == 1.0 and actor.distill_topk == 16
    assert actor.distill_kl_mode == "tail_bucket" and actor.policy_loss
    assert (config.layout.tp, config.layout.cp, config.layout.sp) == (2, 2, True)


def test_distill_keys_are_checked():
    from mcore_ppo.actor import config as config_module
    from mcore_ppo.distill import MAX_TOPK

    assert config_module._MAX_TOPK == MAX_TOPK
    assert not PPOActorConfig().distill
    for kwargs, error, match in [
        ({"distill_coeff": -1.0}, ValueError, "distill_coeff"),
        ({"distill_coeff": float("nan")}, ValueError, "distill_coeff"),
        ({"distill_topk": 0}, ValueError, "distill_topk"),
        ({"distill_topk": MAX_TOPK + 1}, ValueError, "distill_topk"),
        ({"distill_topk": True}, TypeError, "distill_topk"),
        ({"distill_kl_mode": "reverse"}, ValueError, "distill_kl_mode"),
        ({"policy_loss": 0}, TypeError, "policy_loss"),
        ({"policy_loss": False}, ValueError, "needs distill_coeff > 0"),
    ]:
        with pytest.raises(error, match=match):
            PPOActorConfig(**kwargs)
    assert PPOActorConfig(distill_coeff=0.5, policy_loss=False).distill


def _micro_batch_and_teacher(k: int):
    from mcore_ppo.actor.batching import pack_micro_batch
    from mcore_ppo.distill import TopK
    from mcore_ppo_testing.ppo_harness import synthetic_rollout

    rollout = synthetic_rollout(
        num_seqs=3, vocab_size=50, prompt_len=(2, 4), response_len=(3, 6), seed=next_seed(), device="cpu"
    )
    gen = generator(next_seed())
    total = rollout.tokens.shape[0]
    rollout = dataclasses.replace(rollout, old_log_probs=-torch.rand(total, generator=gen))
    log_p = torch.log_softmax(torch.randn(total, 50, generator=gen, dtype=torch.float64), dim=-1)
    values, ids = log_p.topk(k, dim=-1)
    tail = torch.logsumexp(log_p.scatter(-1, ids, -torch.inf), dim=-1)
    teacher = TopK(ids, values.float(), tail.float())
    mb = pack_micro_batch(rollout, [0, 1, 2], align=2)
    return rollout, mb, teacher, log_p


def test_with_teacher_puts_the_teachers_ids_at_the_label_positions():
    from mcore_ppo.actor.distill import check_teacher_topk, with_teacher

    rollout, mb, teacher, _ = _micro_batch_and_teacher(4)
    check_teacher_topk(teacher, rollout.tokens.shape[0])
    dmb = with_teacher(mb, teacher, -100)
    keep = mb.loss_mask[0]
    assert dmb.labels.shape == (1, mb.labels.shape[1], 5)
    assert torch.equal(dmb.labels[0, :, 0], mb.labels[0])
    rows = mb.token_index[0][keep]
    assert torch.equal(dmb.labels[0][keep][:, 1:], teacher.ids[rows])
    assert (dmb.labels[0][~keep] == -100).all()
    assert torch.equal(dmb.teacher_log_probs[0][keep], teacher.log_probs[rows])
    assert (dmb.teacher_tail_log_mass[0][~keep] == 0).all()
    with pytest.raises(ValueError, match=r"teacher.ids must be \[T, k\]"):
        check_teacher_topk(teacher._replace(ids=teacher.ids[:-1]), rollout.tokens.shape[0])
    with pytest.raises(TypeError, match="TopK"):
        check_teacher_topk((teacher.ids, teacher.log_probs), rollout.tokens.shape[0])


@pytest.mark.parametrize("policy", [True, False], ids=["with_ppo", "distill_only"])
def test_distill_loss_matches_the_formula(policy):
    """``distill_loss`` on student log-probs taken from a full distribution: the top-k forward
    KL (tail bucket) token-mean, computed here in fp64 from the definitions, plus the PPO
    surrogate on the sampled token when on."""
    from mcore_ppo.actor.distill import distill_loss, with_teacher
    from mcore_ppo.actor.ppo_loss import compute_policy_loss, loss_weights, sequence_token_counts

    _, mb, teacher, _ = _micro_batch_and_teacher(4)
    config = PPOActorConfig(distill_coeff=0.7, policy_loss=policy, distill_topk=4)
    dmb = with_teacher(mb, teacher, -100)
    counts = sequence_token_counts(mb.loss_mask, mb.seq_index, 3)
    n = float(counts.sum())
    dmb.weights = dmb.metric_weights = loss_weights(
        mb.loss_mask, mb.seq_index, "token-mean", seq_token_counts=counts, num_tokens=n, num_seqs=3.0
    )
    gen = generator(next_seed())
    student = torch.log_softmax(torch.randn(*mb.labels.shape, 50, generator=gen, dtype=torch.float64), dim=-1)
    labels = dmb.labels.clamp(min=0)
    log_q = torch.where(dmb.labels >= 0, student.gather(-1, labels), 0.0).requires_grad_(True)
    entropy = torch.zeros(mb.labels.shape, dtype=torch.float64)
    dmb.advantages = torch.where(mb.loss_mask, 1.0, 0.0).double()
    dmb.old_log_probs = dmb.old_log_probs.double()
    loss, metrics = distill_loss(config, 1.0, dmb, (log_q, entropy))

    keep = mb.loss_mask[0]
    p_log = dmb.teacher_log_probs[0][keep].double()
    q_log = log_q[0, :, 1:][keep].detach()
    p_tail = dmb.teacher_tail_log_mass[0][keep].double()
    q_tail = torch.log1p(-q_log.exp().sum(-1))
    kl = (p_log.exp() * (p_log - q_log)).sum(-1) + p_tail.exp() * (p_tail - q_tail)
    expected = 0.7 * kl.sum() / n
    # The loss weights are fp32 (loss_weights): fp32 rounding of the per-token products.
    torch.testing.assert_close(metrics["distill_kl"].double(), kl.sum() / n, rtol=1e-6, atol=0)
    if policy:
        terms = compute_policy_loss(
            log_q[..., 0].detach(), dmb.old_log_probs, dmb.advantages, clip_ratio_low=0.2, clip_ratio_high=0.2
        )
        expected = expected + (terms.pg_losses * dmb.weights).sum()
    torch.testing.assert_close(loss.detach().double(), expected, rtol=1e-6, atol=0)
    loss.backward()
    assert log_q.grad is not None and (log_q.grad[0][~keep] == 0).all()


TEACHER_GPT = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "vocab_size": 96,
    "max_sequence_length": 48,
}


def _teacher(output_layer: str, seed: int) -> torch.nn.Module:
    """An fp64 teacher GPT (TP 1): the fused head installed, Megatron's own ``ColumnParallelLinear``,
    that with the embedding's weight tied to it, or with two multi-token prediction depths."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from mcore_ppo import install_fused_head
    from mcore_ppo_testing.gpt_builder import build_gpt_model
    from mcore_ppo_testing.ppo_harness import layer_spec

    shape = dict(TEACHER_GPT, tie_embeddings=output_layer == "tied")
    if output_layer == "mtp":
        shape.update(mtp_num_layers=2, mtp_block_spec=lambda c, spec: get_gpt_mtp_block_spec(c, spec, False))
    try:
        gpt = build_gpt_model(**shape, params_dtype=torch.float64, seed=seed, transformer_layer_spec=layer_spec())
    except TypeError as err:  # is_inference_column_parallel_linear checks isinstance against TE placeholders
        if output_layer == "mtp" and "isinstance() arg 2" in str(err):
            pytest.skip(f"this megatron-core cannot build an MTP layer without TransformerEngine ({err})")
        raise
    if output_layer == "fused_head":
        install_fused_head(gpt, backend="torch")
    return gpt


def _teacher_case(teacher: torch.nn.Module, k: int, temperature: float):
    """A rollout over the teacher's vocab and an actor (on the teacher itself) that micro-batches it."""
    from mcore_ppo.actor import MegatronPPOActor
    from mcore_ppo_testing.ppo_harness import synthetic_rollout

    vocab = TEACHER_GPT["vocab_size"]
    rollout = synthetic_rollout(num_seqs=5, vocab_size=vocab, prompt_len=(2, 6), response_len=(3, 12), seed=next_seed())
    config = PPOActorConfig(distill_coeff=1.0, distill_topk=k, temperature=temperature, micro_batch_size=2)
    return rollout, MegatronPPOActor(teacher, torch.optim.SGD(teacher.parameters(), lr=1.0), config)


@pytest.mark.usefixtures("megatron_tp1")
@pytest.mark.parametrize("output_layer", ["fused_head", "column_parallel", "tied"])
def test_teacher_topk_hook_route_matches_post_process_route_and_fp64(output_layer):
    """``compute_teacher_topk`` and one micro-batch's ``teacher_topk_forward`` through the
    ``output_processor`` hook (``post_process`` never set: its setter raises there) and through
    the ``post_process`` route: the same ids, log-probs and tails, ``ignore_index`` ids where the
    labels are ignored, and the top-k of the teacher's fp64 full logits."""
    from mcore_ppo.actor.distill import teacher_topk_forward
    from mcore_ppo.model import supports_output_processor
    from mcore_ppo_testing.distill_demo import full_log_probs, teacher_parity
    from mcore_ppo_testing.hooked_gpt import forward_path, post_process_frozen

    teacher = _teacher(output_layer, next_seed())
    k, temperature = 8, 0.8
    rollout, actor = _teacher_case(teacher, k, temperature)
    mb = actor.micro_batches(rollout)[0]
    assert (mb.labels == -100).any() and (mb.labels != -100).any()

    def both():
        top = actor.compute_teacher_topk(teacher, rollout)
        kw = dict(k=k, temperature=temperature, packed_seq_params=mb.packed_seq_params)
        return top, teacher_topk_forward(teacher, mb.input_ids, mb.position_ids, None, mb.labels, **kw)

    with forward_path(teacher, "hook"), post_process_frozen(teacher):
        assert supports_output_processor(teacher)
        hooked = both()
    with forward_path(teacher, "fallback"):
        assert not supports_output_processor(teacher)
        plain = both()
    for where, a, b in zip(("compute_teacher_topk", "teacher_topk_forward"), hooked, plain, strict=True):
        for name in a._fields:
            msg = lambda m, n=f"{where} {name}": f"hook vs post_process, {n}: {m}"
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=1e-12, msg=msg)
    ignored = mb.labels == -100
    assert (hooked[1].ids[ignored] == -100).all() and (hooked[1].ids[~ignored] >= 0).all()

    full = full_log_probs(teacher, rollout, actor.parallel, temperature=temperature, align=actor.align)
    mask = rollout.response_mask
    assert max(teacher_parity(hooked[0], full, mask)) < 1e-12
    assert (hooked[0].ids[~mask] == -100).all()
    # The guard can fail: the post_process route clears the flag.
    with (
        post_process_frozen(teacher),
        forward_path(teacher, "fallback"),
        pytest.raises(AssertionError, match="post_process"),
    ):
        actor.compute_teacher_topk(teacher, rollout)
    assert teacher.post_process


@pytest.mark.usefixtures("megatron_tp1")
def test_teacher_with_multi_token_prediction_on_the_hook_route():
    """A teacher with two MTP depths: the hook route runs its MTP block and gives the top-k of the
    main tokens' fp64 full logits (those of the same weights without the MTP block); the
    ``post_process`` route refuses it (its hidden states would come with the depths' ones)."""
    from mcore_ppo_testing.distill_demo import full_log_probs, teacher_parity
    from mcore_ppo_testing.hooked_gpt import forward_path, post_process_frozen

    seed = next_seed()
    teacher, without_mtp = _teacher("mtp", seed), _teacher("column_parallel", seed)
    loaded = without_mtp.load_state_dict(teacher.state_dict(), strict=False)
    assert not loaded.missing_keys and loaded.unexpected_keys
    assert all(key.startswith("mtp.") for key in loaded.unexpected_keys)
    rollout, actor = _teacher_case(teacher, 8, 0.8)
    mtp_calls = []
    handle = teacher.mtp.register_forward_hook(lambda *_: mtp_calls.append(1))
    try:
        with forward_path(teacher, "hook"), post_process_frozen(teacher):
            top = actor.compute_teacher_topk(teacher, rollout)
    finally:
        handle.remove()
    assert len(mtp_calls) == len(actor.micro_batches(rollout))
    full = full_log_probs(without_mtp, rollout, actor.parallel, temperature=0.8, align=actor.align)
    assert max(teacher_parity(top, full, rollout.response_mask)) < 1e-12
    with forward_path(teacher, "fallback"), pytest.raises(NotImplementedError, match="multi-token prediction"):
        actor.compute_teacher_topk(teacher, rollout)
    assert teacher.post_process


@pytest.mark.slow
def test_demo_passes_with_parity_lines(tmp_path):
    """The demo config under launch.sh (TP 2 + SP × CP 2, 4 ranks on the CPUs), one step of a
    smaller rollout: a teacher line, an update line, a parity line, and PASS."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["rollout"]["num_seqs"] = 4
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    env = dict(os.environ, MCORE_PPO_LAUNCH_TIMEOUT=str(TIMEOUT - 30), CUDA_VISIBLE_DEVICES="")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "launch.sh"), "--config", str(path), "--steps", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"launch.sh exited {proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert "distillation demo: 4 ranks" in out and "layout TP2+SP × CP2" in out, out
    tol = cfg["run"]["tolerance"]
    teacher = re.findall(r"step 1/1 teacher \| .*max\|Δlog_prob\| (\S+), max\|Δtail_log_mass\| (\S+),", out)
    assert len(teacher) == 1 and all(float(v) <= tol["log_prob"] for v in teacher[0]), out
    parity = re.findall(r"step 1/1 parity \| distill loss: .*max\|Δ\| (\S+) \(KL (\S+)\)", out)
    assert len(parity) == 1 and float(parity[0][0]) <= tol["log_prob"] and float(parity[0][1]) > 0, out
    assert re.search(r"step 1/1 update 1/1 \| loss \S+ distill_kl \S+", out), out
    last = out.strip().splitlines()[-1]
    assert last.startswith("PASS: distillation under TP2+SP × CP2"), last
