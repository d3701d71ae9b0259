#!/usr/bin/env bash
# Installs verl 0.9.1's own source and what `import verl` and verl's Megatron engine
# (verl.workers.engine.megatron.transformer_impl, the live fused path) import, for
# tests/integrations/test_verl_*.py and tests/distributed/test_verl_*.py (which otherwise skip):
# transformers (>= 5.5.3, < 5.11, as verl 0.9.1 asks), tensordict, omegaconf, codetiming, orjson,
# and for the engine package peft, datasets and pillow (verl.workers.engine imports its FSDP
# engines and their dataset code before the Megatron one). verl itself goes in with --no-deps: its full requirements pull
# Ray, vLLM-era pins and wandb that the fused forward under test never uses; where Ray is absent
# the test puts a stand-in on the path (mcore_ppo_testing.real_verl). tensordict 0.15 is newer
# than verl's pin (<= 0.10) because 0.10 predates torch 2.13; verl's imports of it work.
# Run after scripts/install.sh (torch stays as installed). `.ci/run` calls it.
set -euo pipefail
python -m pip install -q "transformers>=5.5.3,<5.11" "tensordict==0.15.3" "omegaconf==2.4.0" "codetiming==1.4.0" orjson \
    "peft==0.21.2" "datasets==5.2.0" pillow
python -m pip install -q --no-deps "verl==0.9.1"
# mbridge, verl's Hugging Face -> Megatron bridge (pure Python; --no-deps: its get_model needs
# TransformerEngine and CUDA, which tests/megatron/test_hf_model.py replaces with the local spec),
# so the HF model tests also check this project's conversion against mbridge's own.
python -m pip install -q --no-deps "mbridge==0.15.1" "einops==0.8.2"
