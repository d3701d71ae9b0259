"""``python -m mcore_ppo.integrations.nemo_rl [SITE_PACKAGES]``: write the ``.pth`` switch
(:func:`mcore_ppo.integrations.nemo_rl.install_pth`) and print where."""

from __future__ import annotations

import sys

from mcore_ppo.integrations.nemo_rl import install_pth

if __name__ == "__main__":
    print(install_pth(sys.argv[1] if len(sys.argv) > 1 else None))
