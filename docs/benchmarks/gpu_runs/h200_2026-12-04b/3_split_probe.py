"""Where the bf16x6 forward's error comes from (ran at 8493a69, whose triton_host had bf16_parts).

Logits of the same fp32 operands by cuBLAS IEEE, by one bf16 GEMM over the six part pairs (small
pairs first, or the big pair first), by the big pair and the small pairs as two GEMMs summed in
fp32, and by the head (fp32_faithful, ieee), against fp64; each one's entropy and log-prob error
(relative to the largest fp64 value)."""

import json

import torch

import mcore_ppo
from mcore_ppo.backends import TritonBackend, TritonConfig
from mcore_ppo.backends.triton_host import bf16_parts
from mcore_ppo.backends.triton_launch import Launcher

torch.backends.cuda.matmul.allow_tf32 = False
h, v, n = 3584, 152064 // 8, 2048
gen = torch.Generator(device="cuda").manual_seed(1234)
x = torch.randn(n, h, device="cuda", generator=gen)
w = torch.randn(v, h, device="cuda", generator=gen) * (2.0 / h**0.5)
labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
launch = Launcher().bound()
x6, w6 = bf16_parts(x, launch, columns=False), bf16_parts(w, launch, columns=True)
z64 = (x.double() @ w.double().T) / 0.7


def ent(z):
    z = z.double()
    return -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)


def lp(z):
    return z.double().log_softmax(-1).gather(1, labels[:, None])[:, 0]


ref_h, ref_lp = ent(z64), lp(z64)


def mm32(a, b):
    return torch.mm(a, b.t(), out_dtype=torch.float32)


def seg(t, k):
    return t[:, k * h : (k + 1) * h]


x_big_first = torch.cat([seg(x6, 5), seg(x6, 3), seg(x6, 4), seg(x6, 0), seg(x6, 1), seg(x6, 2)], 1)
w_big_first = torch.cat([seg(w6, 5), seg(w6, 3), seg(w6, 4), seg(w6, 0), seg(w6, 1), seg(w6, 2)], 1)
variants = {
    "ieee": torch.mm(x, w.t()),
    "bf16x6_small_first": mm32(x6, w6),
    "bf16x6_big_first": mm32(x_big_first, w_big_first),
    "bf16x6_two_gemms": mm32(seg(x6, 5), seg(w6, 5)) + mm32(x6[:, : 5 * h], w6[:, : 5 * h]),
    "bf16_only": mm32(x.bfloat16(), w.bfloat16()),
}
out = {}
for name, z in variants.items():
    z = z / 0.7
    d = z.double() - z64
    out[name] = {
        "z_max_rel": (d.abs().max() / z64.abs().max()).item(),
        "z_bias_rel": ((d * z64.sign()).mean() / z64.abs().mean()).item(),
        "entropy_rel": ((ent(z) - ref_h).abs().max() / ref_h.abs().max()).item(),
        "log_prob_rel": ((lp(z) - ref_lp).abs().max() / ref_lp.abs().max()).item(),
    }
for precision in ("fp32_faithful", "ieee"):
    backend = TritonBackend(TritonConfig(precision=precision))
    lpo, ento = mcore_ppo.fused_log_probs_and_entropy(x, w, labels, temperature=0.7, backend=backend)
    out["head_" + precision] = {
        "entropy_rel": ((ento.double() - ref_h).abs().max() / ref_h.abs().max()).item(),
        "log_prob_rel": ((lpo.double() - ref_lp).abs().max() / ref_lp.abs().max()).item(),
    }
print(json.dumps(out, indent=1))
