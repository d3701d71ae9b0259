"""A Hugging Face rollout on the CPU for verl's agent loop: verl's rollout interfaces, no GPU.

verl 0.9.1's trainer generates through rollout *replicas* (``RolloutReplica``: servers that
answer ``generate()`` with a ``TokenOutput``) and syncs the actor's weights into them through a
``BaseRollout`` living in each actor worker. Its registries know vLLM, SGLang and TensorRT-LLM
only, all GPU servers. This module adds ``hf_cpu`` to both, through verl's own registries
(``RolloutReplicaRegistry.register`` and the ``_ROLLOUT_REGISTRY`` table that
``get_rollout_class`` reads):

- :class:`HFServer` (a Ray actor, one per replica) holds ``AutoModelForCausalLM`` in fp32 and
  samples one request at a time: softmax of the last position's logits at the request's
  temperature, drawn from a generator seeded by the rollout seed, the request id and how often
  that id came before (verl's ``rollout.full_determinism=True`` makes request ids stable, so
  equal weights give equal samples run after run). The log-probs it returns are a teacher-forced
  fp32 forward over prompt and response: the fp32 reference of the sampled tokens.
- :class:`HFReplica` starts that actor (``launch_servers``) and answers sleep/wake-up/abort.
- :class:`HFServerAdapter` is the actor workers' side of verl's naive weight sync
  (``checkpoint_engine.backend=naive``): every rank walks the exported weights (the export is
  collective), the replica's first rank sends them to its server.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ROLLOUT_NAME", "HFServer", "adapter_class", "server_name"]  # and, built on use, HFReplica, HFServerAdapter

ROLLOUT_NAME = "hf_cpu"


def server_name(replica_rank: int, role: str = "") -> str:
    """The Ray actor name of replica ``replica_rank``'s server (how the adapter finds it);
    ``role`` tells a teacher's apart."""
    return f"{ROLLOUT_NAME}_server_{role}{replica_rank}"


def _replica_world_size(config: Any) -> int:
    return config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size


class HFServer:
    """One replica's server: a Hugging Face causal LM in fp32 that samples token in, token out."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        self.replica_rank = replica_rank
        path = getattr(model_config, "local_path", None) or model_config["path"]  # dataclass or DictConfig
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.seen: dict[str, int] = {}
        self.lock = asyncio.Lock()
        self.weight_updates = 0

    def _generator(self, request_id: str) -> torch.Generator:
        occurrence = self.seen.get(request_id, 0)
        self.seen[request_id] = occurrence + 1
        digest = hashlib.sha256(f"{self.config.seed}/{request_id}/{occurrence}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    @torch.no_grad()
    def _sample(self, prompt_ids: list[int], params: dict[str, Any], request_id: str) -> tuple[list[int], list[float]]:
        max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
        if max_tokens is None:
            max_tokens = min(
                self.config.response_length,
                self.config.prompt_length + self.config.response_length - len(prompt_ids),
            )
        temperature = float(params.get("temperature", 1.0))
        top_k, top_p = int(params.get("top_k", -1)), float(params.get("top_p", 1.0))
        generator = self._generator(request_id)
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        out = self.model(input_ids=ids, use_cache=True)
        response: list[int] = []
        for _ in range(max(1, int(max_tokens))):
            logits = out.logits[0, -1].float()
            if temperature <= 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(_filtered(logits / temperature, top_k, top_p), dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            response.append(token)
            if token in self.eos_ids:
                break
            out = self.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        # The fp32 reference of the sampled tokens: one teacher-forced pass, as the actor computes them.
        full = torch.tensor([prompt_ids + response], dtype=torch.long)
        logits = self.model(input_ids=full).logits[0, len(prompt_ids) - 1 : -1].float()
        scale = temperature if temperature > 0 else 1.0
        log_probs = torch.log_softmax(logits / scale, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        return response, log_probs.tolist()

    @torch.no_grad()
    def _prompt_top_k(self, prompt_ids: list[int], k: int) -> dict[str, list[list[Any]]]:
        """A teacher's answer to ``prompt_logprobs=k`` in vLLM's layout (verl's distillation reads
        it): row ``j`` holds the top-``k`` ids and fp32 log-probs predicting token ``j + 1``; the
        last row is zeros."""
        logits = self.model(input_ids=torch.tensor([prompt_ids])).logits[0, :-1].float()
        top = torch.log_softmax(logits, dim=-1).topk(max(k, 1), dim=-1)
        width = max(k, 1)
        return {
            "prompt_ids": [*top.indices.tolist(), [0] * width],
            "prompt_logprobs": [*top.values.tolist(), [0.0] * width],
        }

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **_: Any) -> Any:
        """verl's token-in-token-out call: the sampled ids and their fp32 log-probs (and, asked
        ``prompt_logprobs``, the prompt's top-k as a distillation teacher)."""
        from verl.workers.rollout.replica import TokenOutput

        if sampling_params.get("prompt_logprobs") is not None:
            async with self.lock:
                extra = self._prompt_top_k(list(prompt_ids), int(sampling_params["prompt_logprobs"]))
            return TokenOutput(token_ids=[0], log_probs=None, stop_reason="length", extra_fields=extra)
        async with self.lock:  # one request at a time: a request's numbers never depend on another's
            ids, log_probs = self._sample(list(prompt_ids), dict(sampling_params), request_id)
        stop = "completed" if ids and ids[-1] in self.eos_ids else "length"
        return TokenOutput(
            token_ids=ids, log_probs=log_probs if sampling_params.get("logprobs") else None, stop_reason=stop
        )

    async def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """The actor's exported Hugging Face weights, copied into the fp32 model; returns how many."""
        async with self.lock:
            missing = set(state_dict) - set(self.model.state_dict())
            if missing:
                raise KeyError(f"weights the rollout model does not have: {sorted(missing)[:5]}")
            self.model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
            self.weight_updates += 1
        return len(state_dict)

    async def get_weight_updates(self) -> int:
        return self.weight_updates

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    release_kv_cache = resume_kv_cache = resume_generation = open_submission_gate = clear_kv_cache
    resume_engine_generation = wait_for_requests_to_drain = stop_profile = clear_kv_cache

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def set_global_steps(self, global_steps: int) -> None:
        return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        return {}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {}


def _filtered(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top-k / nucleus set to -inf (verl's ``-1`` and ``1.0`` keep all)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _replica_class() -> type:
    import ray
    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """A replica of one :class:`HFServer` actor: hybrid (the actor's rollout, weights synced
        from it) or standalone (a distillation teacher, its own weights, no worker group)."""

        async def init_standalone(self) -> None:
            from verl.workers.rollout.replica import RolloutMode

            self.rollout_mode = RolloutMode.STANDALONE
            await self.launch_servers()

        async def init_colocated(self, resource_pool: Any) -> None:
            # verl's own colocated replicas start a worker group of its rollout adapters for
            # checkpoint-engine syncs; a teacher here keeps its weights and needs none.
            from verl.workers.rollout.replica import RolloutMode

            self.rollout_mode, self.resource_pool = RolloutMode.COLOCATED, resource_pool
            await self.launch_servers()

        async def launch_servers(self) -> None:
            role = "teacher_" if self.is_teacher_model else "reward_" if self.is_reward_model else ""
            name = server_name(self.replica_rank, role) + self.name_suffix
            server = (
                ray.remote(HFServer)
                .options(name=name, max_concurrency=self.max_concurrency)
                .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
            )
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"{ROLLOUT_NAME}-{self.replica_rank}:0"

        def rollout_worker_use_gpu(self) -> bool:
            return False

    return HFReplica


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """``HFReplica`` and ``HFServerAdapter``, built on first use: they subclass verl's classes,
    which this module does not import until verl asks for them (by name, from its registries)."""
    builders = {"HFReplica": _replica_class, "HFServerAdapter": adapter_class}
    if name not in builders:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        _BUILT[name] = builders[name]()
    return _BUILT[name]


def adapter_class() -> type:
    """The ``BaseRollout`` subclass verl's ``get_rollout_class("hf_cpu")`` returns."""
    from verl.workers.rollout.base import BaseRollout

    class Adapter(BaseRollout):
        """verl's ``BaseRollout`` in an actor worker for ``hf_cpu``: the weight sync to the server."""

        def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, model_config, device_mesh, *args, **kwargs)
            rank, size = int(os.environ["RANK"]), _replica_world_size(self.config)
            self.replica_rank, self.leader = rank // size, rank % size == 0
            self._server: Any = None

        def _handle(self) -> Any:
            if self._server is None:
                import ray

                self._server = ray.get_actor(server_name(self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]) -> None:
            return None

        async def release(self) -> None:
            return None

        async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], **kwargs: Any) -> None:
            # Every rank walks the export (it gathers TP shards collectively); the leader sends.
            state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
            if self.leader:
                await self._handle().update_weights.remote(state)

    Adapter.__name__ = Adapter.__qualname__ = "HFServerAdapter"
    return Adapter
