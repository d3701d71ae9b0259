"""The public API imports and names what the README promises."""

import mcore_ppo
import mcore_ppo.parallel


def test_public_names():
    assert callable(mcore_ppo.fused_log_probs_and_entropy)
    assert issubclass(mcore_ppo.VocabParallelFusedPPOHead, __import__("torch").nn.Module)
    assert callable(mcore_ppo.parallel.split_for_cp) and callable(mcore_ppo.parallel.roll_and_split_labels)
