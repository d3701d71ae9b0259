#!/usr/bin/env python
"""The product files one head call passes through, forward and backward (kernels excluded).

Runs ``fused_log_probs_and_entropy`` once to warm up (plans, compiled kernels), then records with
``sys.setprofile`` / ``threading.setprofile`` which ``mcore_ppo`` files a second call enters: its
forward, then its backward (autograd's engine may run it in another thread). On a machine
without CUDA the triton backend runs under ``TRITON_INTERPRET=1`` (set here if unset); the
kernels' own module is left out (under the interpreter its Python would be counted).

Usage: ``python scripts/call_files.py [--backend triton|torch] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="triton", help="the head's backend (default: triton)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import mcore_ppo
    from mcore_ppo import fused_log_probs_and_entropy

    root = Path(mcore_ppo.__file__).parent
    kernels = root / "kernels"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(32, 64, generator=gen).to(device).requires_grad_()
    weight = torch.randn(128, 64, generator=gen).to(device).requires_grad_()
    labels = torch.randint(0, 128, (32,), generator=gen).to(device)

    def call():
        log_prob, entropy = fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend=args.backend)
        return log_prob.sum() + entropy.sum()

    call().backward()  # warm-up
    seen: dict[str, set[str]] = {"forward": set(), "backward": set()}
    phase = "forward"

    def record(frame, event, _arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(root) and not path.is_relative_to(kernels):
                seen[phase].add(str(path.relative_to(root)))

    sys.setprofile(record)
    loss = call()
    sys.setprofile(None)
    phase = "backward"
    threading.setprofile(record)
    sys.setprofile(record)
    loss.backward()
    sys.setprofile(None)
    threading.setprofile(None)
    result = {name: sorted(files) for name, files in seen.items()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name, files in result.items():
        print(f"{name}: {len(files)} files: {', '.join(files)}")


if __name__ == "__main__":
    main()
