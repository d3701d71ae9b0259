#!/usr/bin/env python
"""The product files one head call passes through, forward and backward (kernels excluded).

Runs ``fused_log_probs_and_entropy`` once to warm up (plans, compiled kernels), then records with
``sys.setprofile`` which ``mcore_ppo`` files a second call enters: its forward, then its backward
(set from inside it: autograd's engine runs it in a thread of its own for CUDA tensors). On CUDA
the operands are bf16 (fp32 ones would take cuBLAS's IEEE route, the torch backend's pass); on a
machine without CUDA they are fp32 and the triton backend runs under ``TRITON_INTERPRET=1`` (set
here if unset). The kernels' own module is left out (under the interpreter its Python would be
counted).

Usage: ``python scripts/call_files.py [--backend triton|torch] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
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
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden = torch.randn(32, 64, generator=gen).to(device, dtype).requires_grad_()
    weight = torch.randn(128, 64, generator=gen).to(device, dtype).requires_grad_()
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
    # The backward's nodes run in autograd's own thread for CUDA tensors (a thread that neither
    # sys.setprofile nor threading.setprofile reaches): the profile is set from inside the
    # backward, by a pre-hook of its first node, and unset once the gradients are accumulated.
    loss.grad_fn.register_prehook(lambda *_: sys.setprofile(record))
    for leaf in (hidden, weight):
        leaf.register_post_accumulate_grad_hook(lambda _: sys.setprofile(None))
    loss.backward()
    sys.setprofile(None)
    result = {name: sorted(files) for name, files in seen.items()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name, files in result.items():
        print(f"{name}: {len(files)} files: {', '.join(files)}")


if __name__ == "__main__":
    main()
