"""The Markdown tables of ``scripts/bench_precision.py`` and ``scripts/bench_mismatch.py``
reports: the record and the summary page show them, and a docs test rebuilds them from the JSON."""

from __future__ import annotations


def _g(value: float) -> str:
    return f"{value:.2g}"


def precision_table(report: dict) -> str:
    """fp32 inputs under each precision beside the bf16 one-GEMM floor and cuBLAS's IEEE GEMM
    (``fp32_faithful``'s products named by the report's ``faithful_dot``; reports before it
    have none: Triton's 3×TF32 dots)."""
    ms, errors = report["ms"], report["errors"]
    faithful = {"fp16x3": "fp16 parts"}.get(report.get("faithful_dot"), "3×TF32")
    bf16, ieee_gemm = ms["bf16_gemm"], ms["fp32_ieee_gemm"]
    rows = [
        ("cuBLAS bf16 GEMM (the floor)", ms["bf16_gemm"], None),
        ("cuBLAS IEEE fp32 GEMM", ms["fp32_ieee_gemm"], None),
        (f'head, `precision="fp32_faithful"` ({faithful})', ms["faithful"], errors["faithful"]),
        ('head, `precision="ieee"`', ms["ieee"], errors["ieee"]),
    ]
    lines = [
        "| forward | ms | × bf16 GEMM | × IEEE fp32 GEMM | rel. error vs fp64: log p / entropy |",
        "|---|---|---|---|---|",
    ]
    for name, value, err in rows:
        cell = "-" if err is None else f"{_g(err['log_prob'])} / {_g(err['entropy'])}"
        lines.append(f"| {name} | {value:.2f} | {value / bf16:.2f} | {value / ieee_gemm:.2f} | {cell} |")
    return "\n".join(lines)


def sweep_table(report: dict) -> str:
    """The forward's time at other tiles (``--sweep``), as given to ``TritonConfig(forward_config=)``."""
    bf16 = report["ms"]["bf16_gemm"]
    lines = [
        "| precision | tiles (M × N × K before fp32 halving / stages / warps) | ms | × bf16 GEMM |",
        "|---|---|---|---|",
    ]
    for name, value in report["forward_tiles_sweep_ms"].items():
        precision, tiles = name.split(" ", 1)
        lines.append(f"| `{precision}` | {tiles} | {value:.2f} | {value / bf16:.2f} |")
    return "\n".join(lines)


def _tiles(text: str) -> str:
    """``"(128, 128, 64, 2, 8)"`` as ``128x128x64/s2/w8``; ``"default"`` as it is."""
    if text == "default":
        return text
    m, n, k, stages, warps = (int(v) for v in text.strip("()").split(","))
    return f"{m}x{n}x{k}/s{stages}/w{warps}"


def tiles_sweep_table(report: dict) -> str:
    """Forward and forward + backward at other tiles, with and without the probability buffer,
    and the gradients' error (``--sweep``'s ``tiles_sweep``; ``default``: the backend's)."""
    rows: dict[tuple[str, str, str], dict[str, dict]] = {}
    for name, row in report["tiles_sweep"].items():
        head, mode = name.rsplit(" ", 1)
        precision, rest = head.split(" fwd ", 1)
        forward, backward = rest.split(" bwd ", 1)
        rows.setdefault((precision, _tiles(forward), _tiles(backward)), {})[mode] = row
    lines = [
        "| precision | forward tiles | backward tiles | buffer: forward / step ms | recompute: forward / step ms "
        "| d_hidden / d_W error (larger of the two modes) |",
        "|---|---|---|---|---|---|",
    ]
    for (precision, forward, backward), modes in rows.items():
        cells = [f"{modes[m]['forward_ms']:.2f} / {modes[m]['step_ms']:.2f}" for m in ("buffer", "recompute")]
        dx, dw = (max(modes[m][key] for m in modes) for key in ("d_hidden_rel_err", "d_weight_rel_err"))
        lines.append(f"| `{precision}` | {forward} | {backward} | {cells[0]} | {cells[1]} | {_g(dx)} / {_g(dw)} |")
    return "\n".join(lines)


def mismatch_table(report: dict) -> str:
    """A bf16 model's head four ways against fp64."""
    names = {
        "head": "the head, default options",
        "head_fp32_faithful": 'the head, `precision="fp32_faithful"`',
        "fp32_lm_head": "fp32 LM head over materialised logits",
        "bf16_logits": "bf16 logits, fp32 log-softmax (verl's logits path)",
    }
    lines = [
        "| variant | mean / max abs Δ log p | mean / max abs Δ entropy | KL mean / max | forward ms | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for key, name in names.items():
        v = report["variants"][key]
        lines.append(
            f"| {name} | {_g(v['mean_abs_dlogp'])} / {_g(v['max_abs_dlogp'])} | "
            f"{_g(v['mean_abs_dentropy'])} / {_g(v['max_abs_dentropy'])} | "
            f"{_g(v['kl']['mean'])} / {_g(v['kl']['max'])} | "
            f"{v['forward_ms']:.2f} | {v['peak_gib']:.3f} |"
        )
    return "\n".join(lines)
