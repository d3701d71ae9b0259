"""Adapters that switch the head on inside the RL stacks users run, without editing them.

- :mod:`mcore_ppo.integrations.verl`: a verl plugin (entry point ``verl.plugins``, or
  ``VERL_USE_EXTERNAL_MODULES``) that routes verl's Megatron fused log-prob/entropy path to the
  head.
- :mod:`mcore_ppo.integrations.nemo_rl`: NeMo-RL's hidden-states-to-log-probs call with context
  parallelism, packed sequences, temperature and entropy.

Each translates the framework's call into :func:`mcore_ppo.head_call.run_head` (through
:mod:`mcore_ppo.integrations.verl.kernel` for verl) and imports nothing of the framework at import time, so
loading one costs nothing where the framework's path is never taken. ``docs/integrations.md``
has the switches, the contracts and the upstream code they were read from.
"""
