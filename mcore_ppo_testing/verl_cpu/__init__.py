"""verl's own trainer, ``python -m verl.trainer.main_ppo``, on a CPU machine, verl unedited.

verl 0.9.1 has no CPU platform and no GPU-free rollout wired to its trainer.
:mod:`.external` is the module verl loads in every process it starts
(``VERL_USE_EXTERNAL_MODULES``) to supply both (:mod:`.platform`, :mod:`.rollout`), the
Megatron engine's CPU shims (:mod:`.megatron`) and the test's records (:mod:`.records`).
:mod:`.run` builds a tiny model, tokenizer, data set and reward (:mod:`.assets`), runs
``main_ppo`` in a subprocess with the settings a CPU needs and reads back its metrics and
records; :mod:`.compare` and :mod:`.record` turn runs into the on/off comparison. Importing this
package, or any module of it but :mod:`.external`, changes nothing in the process.
"""
