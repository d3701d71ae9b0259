"""The tiny inputs of a CPU ``main_ppo`` run: a random Qwen2, a character tokenizer, prompts, a reward.

- The model: Hugging Face ``Qwen2ForCausalLM`` (2 layers, hidden 64, vocab 2048, untied), every
  weight drawn from a seed (:func:`mcore_ppo_testing.hf_models.random_qwen2_model`) and rounded to
  bf16, saved as fp32: the bf16 Megatron actor and the fp32 rollout hold the same numbers.
- The tokenizer, in its own folder (transformers 5 would read a tokenizer beside a qwen2
  ``config.json`` as Qwen2's BPE): one token per character (``"\\n"`` one token, as verl's
  Qwen continuous-token builder needs), Qwen's chat markers, the rest of the 2048 ids as
  placeholder tokens, so every id the model samples decodes.
- A teacher for distillation: the same shape, drawn from the next seed.
- The data: ``n`` prompts of random letters in verl's RL parquet layout (chat ``prompt``,
  ``data_source``, ``reward_model.ground_truth``).
- The reward (:data:`REWARD_SOURCE`): the share of the response's characters that are digits or
  occur in the ground truth, a score in ``[0, 1]`` that differs between the samples of one
  prompt (most sampled ids are placeholders such as ``<x123>``), so GRPO's advantages are not
  all zero.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["REWARD_SOURCE", "RunAssets", "make_assets"]

VOCAB_SIZE = 2048
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REWARD_SOURCE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Share of the response's characters that are digits or occur in the ground truth."""
    if not solution_str:
        return 0.0
    return sum(ch.isdigit() or ch in ground_truth for ch in solution_str) / len(solution_str)
'''


@dataclass(frozen=True)
class RunAssets:
    """Paths of one run's inputs."""

    model: Path
    tokenizer: Path
    train_files: Path
    reward: Path
    teacher: Path


def _tokenizer(folder: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    fillers = [f"<x{i}>" for i in range(VOCAB_SIZE - len(SPECIALS) - len(characters))]
    vocab = {token: index for index, token in enumerate([*SPECIALS, *characters, *fillers])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def _model(folder: Path, seed: int, eos_token_id: int, pad_token_id: int) -> None:
    from mcore_ppo_testing.hf_models import random_qwen2_model, small_qwen2_config

    config = small_qwen2_config(vocab_size=VOCAB_SIZE, intermediate_size=128, max_position_embeddings=256)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = eos_token_id, pad_token_id, None
    model = random_qwen2_model(config, seed=seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(folder, safe_serialization=True)


def _data(path: Path, prompts: int, seed: int) -> None:
    import pandas as pd

    rng = random.Random(seed)
    rows = []
    for index in range(prompts):
        question = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(6, 14)))
        rows.append(
            {
                "data_source": "mcore_ppo_letters",
                "prompt": [{"role": "user", "content": question}],
                "ability": "letters",
                "reward_model": {"style": "rule", "ground_truth": question},
                "extra_info": {"index": index},
            }
        )
    pd.DataFrame(rows).to_parquet(path)


def make_assets(folder: Path, *, seed: int, prompts: int = 8) -> RunAssets:
    """Write the model, tokenizer, data set and reward function of a run into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    assets = RunAssets(
        folder / "model", folder / "tokenizer", folder / "train.parquet", folder / "reward.py", folder / "teacher"
    )
    _tokenizer(assets.tokenizer)
    vocab = json.loads((assets.tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    special = {"eos_token_id": vocab["<|im_end|>"], "pad_token_id": vocab["<|endoftext|>"]}
    _model(assets.model, seed, **special)
    _model(assets.teacher, seed + 1, **special)
    _data(assets.train_files, prompts, seed)
    assets.reward.write_text(REWARD_SOURCE)
    return assets
