#!/usr/bin/env python
"""The product files one head call passes through, forward and backward (kernels excluded).

Runs ``fused_log_probs_and_entropy`` once to warm up (plans, compiled kernels), then records with
``sys.setprofile`` which ``mcore_ppo`` files, and how many of their functions, a call enters:

- ``forward_first``: the forward of the first call of a signature (new options: the checks run);
- ``forward``: a later call of it (a prepared call: its checks skipped, docs/design.md §9);
- ``backward``: that later call's backward (set from inside it: autograd's engine runs it in a
  thread of its own for CUDA tensors).

On CUDA the operands are bf16 (fp32 ones would take cuBLAS's IEEE route, the torch backend's
pass); on a machine without CUDA they are fp32, the triton backend runs under
``TRITON_INTERPRET=1`` (set here if unset), and the labels' values are left unread, as a CUDA
call leaves them (``mcore_ppo_testing.stub_launch.cuda_like_checks``; else ``validate`` on CPU
tensors reads them and every call takes the checks). The kernels' own module is left out (under
the interpreter its Python would be counted).

Usage: ``python scripts/call_files.py [--backend triton|torch] [--json]`` (``--json``: each phase's files
with the functions entered in each)
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
    from mcore_ppo import HeadOptions, fused_log_probs_and_entropy

    root = Path(mcore_ppo.__file__).parent
    kernels = root / "kernels"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        from mcore_ppo_testing.stub_launch import cuda_like_checks

        values_unread = cuda_like_checks()
        values_unread.__enter__()  # for the whole run (held: a dropped one would be closed)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden = torch.randn(32, 64, generator=gen).to(device, dtype).requires_grad_()
    weight = torch.randn(128, 64, generator=gen).to(device, dtype).requires_grad_()
    labels = torch.randint(0, 128, (32,), generator=gen).to(device)

    def call(options):
        log_prob, entropy = fused_log_probs_and_entropy(hidden, weight, labels, temperature=0.7, options=options)
        return log_prob.sum() + entropy.sum()

    call(HeadOptions(backend=args.backend)).backward()  # warm-up
    seen: dict[str, dict[str, set[str]]] = {"forward_first": {}, "forward": {}, "backward": {}}
    phase = "forward_first"

    def record(frame, event, _arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(root) and not path.is_relative_to(kernels):
                seen[phase].setdefault(str(path.relative_to(root)), set()).add(frame.f_code.co_name)

    options = HeadOptions(backend=args.backend)  # a new signature: its first call takes the checks
    for phase in ("forward_first", "forward"):
        sys.setprofile(record)
        loss = call(options)
        sys.setprofile(None)
        if phase == "forward_first":
            loss.backward()
    phase = "backward"
    # The backward's nodes run in autograd's own thread for CUDA tensors (a thread that neither
    # sys.setprofile nor threading.setprofile reaches): the profile is set from inside the
    # backward, by a pre-hook of its first node, and unset once the gradients are accumulated.
    loss.grad_fn.register_prehook(lambda *_: sys.setprofile(record))
    for leaf in (hidden, weight):
        leaf.register_post_accumulate_grad_hook(lambda _: sys.setprofile(None))
    loss.backward()
    sys.setprofile(None)
    if args.json:
        listed = {
            name: {file: sorted(functions) for file, functions in sorted(files.items())} for name, files in seen.items()
        }
        print(json.dumps(listed, indent=1))
        return
    for name, files in seen.items():
        functions = sum(len(names) for names in files.values())
        print(f"{name}: {len(files)} files, {functions} functions: {', '.join(sorted(files))}")


if __name__ == "__main__":
    main()
