"""The figures README.md and docs/*.md quote come from the tables in docs/benchmarks/, the tables
agree with the raw JSON and logs they were made from, and every relative link resolves.

Pure text and JSON parsing. A figure agrees with its source when the source value rounds to it at
the figure's own precision: "1.07" agrees with 1.068 and with "1.07", "1.9e-6" with 1.86e-06. A
table cell exactly half-way between two figures ("1.325" for "1.32" or "1.33") agrees with
neither: quote it at the table's precision. Each sentence that quotes figures is found by a
pattern; the figures it captures are checked against the cited table, so a number changed by hand
in the text or in a table fails here, and so does a sentence rewritten without updating its
pattern. In the README's Results section and its Distillation paragraph every figure must be one
a pattern checks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "docs" / "benchmarks"

# A figure: 1.07, 0.5, 2.4e-6, 16,384 (not part of a version such as 0.8.5 or a word such as 1.8B).
NUMBER = r"\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?(?:e-\d+)?"
FIGURE = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+\.\d+(?:e-\d+)?|\d+e-\d+)(?![\w]|\.\d)")
RANGE = rf"(?P<lo>{NUMBER})–(?P<hi>{NUMBER})"


# ---------------------------------------------------------------------------------------------
# Reading Markdown


@cache
def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def flat(s: str) -> str:
    """Whitespace runs as one space, so a sentence matches however its lines wrap."""
    return re.sub(r"\s+", " ", s)


@dataclass(frozen=True)
class Table:
    path: Path
    heading: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def col(self, name: str) -> int:
        names = [h.lower() for h in self.header]
        assert name.lower() in names, f"{self.path.name}: no column {name!r} in {self.header}"
        return names.index(name.lower())

    def dicts(self) -> list[dict[str, str]]:
        return [dict(zip((h.lower() for h in self.header), row, strict=True)) for row in self.rows]

    def where(self, **match) -> list[dict[str, str]]:
        """Rows whose columns (underscores in the keyword for spaces) equal the given text."""
        out = []
        for row in self.dicts():
            if all(row[key.replace("_", " ").lower()] == str(value) for key, value in match.items()):
                out.append(row)
        return out

    def one(self, **match) -> dict[str, str]:
        rows = self.where(**match)
        assert len(rows) == 1, f"{self.path.name}: {len(rows)} rows match {match}"
        return rows[0]


def _cells(line: str) -> tuple[str, ...]:
    line = line.strip().replace("\\|", "\x00")
    cells = line.strip("|").split("|")
    return tuple(clean(c.replace("\x00", "|")) for c in cells)


def clean(cell: str) -> str:
    return cell.replace("**", "").replace("`", "").strip()


@cache
def tables(path: Path) -> tuple[Table, ...]:
    out, heading, block = [], "", []
    for line in [*text(path).splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            header, rule, *rows = block
            assert set(rule.replace("|", "").strip()) <= {"-", ":", " "}, f"{path}: not a table rule: {rule}"
            out.append(Table(path, heading, _cells(header), tuple(_cells(r) for r in rows)))
            block = []
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
    return tuple(out)


def table(path: Path, *columns: str, under: str | None = None) -> Table:
    """The one table of `path` whose header has all `columns` (under a heading containing `under`)."""
    found = [
        t
        for t in tables(path)
        if all(c.lower() in (h.lower() for h in t.header) for c in columns) and (under is None or under in t.heading)
    ]
    assert len(found) == 1, f"{path.relative_to(REPO)}: {len(found)} tables with columns {columns} under {under!r}"
    return found[0]


def numbers(cell: str) -> list[str]:
    return re.findall(NUMBER, cell)


# ---------------------------------------------------------------------------------------------
# Comparing figures


def dec(value) -> Decimal:
    """A table cell's or a JSON value's number, exactly (a float as the binary value it holds)."""
    if isinstance(value, str):
        return Decimal(value.replace(",", ""))
    return Decimal(value)


def agrees(figure: str, value) -> bool:
    quoted = dec(figure)
    quantum = Decimal(1).scaleb(quoted.as_tuple().exponent)
    distance = abs(quoted - dec(value)) * 2
    if distance < quantum:
        return True
    # A raw value exactly half-way (2.125 GiB) is what Python's formatting rounds to even; a table
    # cell half-way (1.325) hides on which side its own source lay, so it agrees with neither.
    return (
        distance == quantum and not isinstance(value, str) and quoted == dec(value).quantize(quantum, ROUND_HALF_EVEN)
    )


def check(figure: str, value, what: str) -> None:
    assert agrees(figure, value), f"{what}: the text says {figure}, the source gives {value}"


def check_range(match: re.Match, values, what: str, lo: str = "lo", hi: str = "hi") -> None:
    values = [dec(v) for v in values]
    assert values, f"{what}: no source values"
    check(match[lo], min(values), f"{what} (lowest)")
    check(match[hi], max(values), f"{what} (highest)")


def check_cells(cell: str, values, what: str) -> None:
    """Every figure of a cell against its source value, in order (a '-' cell: no value)."""
    values = list(values)
    if all(v is None for v in values):
        assert cell in {"-", ""}, f"{what}: {cell!r} where the source has no value"
        return
    found = numbers(cell)
    assert len(found) == len(values), f"{what}: {cell!r} holds {found}, expected {len(values)} figures"
    for figure, value in zip(found, values, strict=True):
        check(figure, value, what)


class Claims:
    """The sentences of one text that quote figures, and the spans of the figures they check."""

    def __init__(self, body: str, name: str):
        self.body, self.name, self.spans = flat(body), name, []

    def find(self, pattern: str) -> re.Match:
        found = list(re.finditer(pattern, self.body))
        assert len(found) == 1, f"{self.name}: {len(found)} matches of {pattern!r} (the sentence was changed?)"
        match = found[0]
        self.spans += [match.span(g) for g in range(1, (match.lastindex or 0) + 1) if match.start(g) >= 0]
        return match

    def unchecked(self) -> list[str]:
        return [
            f.group()
            for f in FIGURE.finditer(self.body)
            if not any(a <= f.start() and f.end() <= b for a, b in self.spans)
        ]


# ---------------------------------------------------------------------------------------------
# Sources


@cache
def load(relative: str) -> dict:
    return json.loads(text(BENCH / relative))


def json_in_log(relative: str) -> dict:
    body = text(BENCH / relative)
    return json.loads(body[body.index("\n{") + 1 : body.rindex("}") + 1])


def bench_head() -> Table:
    return table(BENCH / "bench_head_table.md", "shape", "impl", "fwd / 1 GEMM")


def head_vocabs() -> Table:
    return table(BENCH / "head_h200.md", "shape", "recompute fwd / 1 GEMM", under="three vocabularies")


def teacher() -> Table:
    return table(BENCH / "distillation_h200.md", "triton × gemm, GPU")


def student(under: str) -> Table:
    return table(BENCH / "distillation_h200.md", "impl", "× four-GEMM floor", under=under)


def ppo_step() -> Table:
    return table(BENCH / "multi_gpu" / "README.md", "layout", "fused / logits")


def micro_batch() -> Table:
    return table(BENCH / "multi_gpu" / "README.md", "largest micro-batch that fits")


def long_context() -> Table:
    return table(BENCH / "ppo_step" / "long_context_tp1.md", "sequence length")


def column(rows, name: str) -> list[str]:
    return [v for row in rows for v in numbers(row[name.lower()])]


def ours(rows):
    return [r for r in rows if r["impl"].startswith("ours_triton")]


# ---------------------------------------------------------------------------------------------
# The tables against their raw data

BENCH_HEAD_CELLS = {
    "v/tp": lambda e, r: [e["vocab_local"]],
    "1 gemm ms": lambda e, r: [e["floor"]["gemm1_ms"]],
    "4 gemms ms": lambda e, r: [e["floor"]["gemm4_ms"]],
    "fwd ms": lambda e, r: [r["fwd_ms"]],
    "no-grad fwd ms": lambda e, r: [r["nograd_fwd_ms"]],
    "fwd+bwd ms": lambda e, r: [r.get("fwd_bwd_ms")],
    "fwd / 1 gemm": lambda e, r: [r["fwd_ratio"]],
    "fwd+bwd / 4 gemms": lambda e, r: [r.get("fwd_bwd_ratio")],
    "peak extra gib (grads)": lambda e, r: [r["peak_extra_gib"], e["output_grads_gib"]],
    "logp err": lambda e, r: [r.get("logp_rel_err")],
    "entropy err": lambda e, r: [r.get("entropy_rel_err")],
    "d_hidden err": lambda e, r: [r.get("dhidden_rel_err")],
    "d_w err": lambda e, r: [r.get("dweight_rel_err")],
}


def test_bench_head_table_is_its_json():
    report = load("bench_head.json")
    entries = {(e["shape"], str(e["tp"])): e for e in report["results"]}
    rows = bench_head().dicts()
    measured = [(k, name) for k, e in entries.items() for name, r in e["impls"].items() if "fwd_ms" in r]
    assert len(rows) == len(measured) > 0
    for row in rows:
        entry = entries[(row["shape"], row["tp"])]
        result = entry["impls"][row["impl"]]
        for name, values in BENCH_HEAD_CELLS.items():
            check_cells(
                row[name],
                values(entry, result),
                f"bench_head_table.md {row['shape']} tp {row['tp']} {row['impl']} {name}",
            )


def test_head_vocabularies_table_is_its_json():
    report = load("gpu_runs/h200_2026-12-01c/5_bench_head_ours.json")
    entries = {(e["shape"], str(e["tp"])): e for e in report["results"]}
    rows = head_vocabs().dicts()
    assert {(r["shape"], r["tp"]) for r in rows} == set(entries)
    for row in rows:
        e = entries[(row["shape"], row["tp"])]
        rec, buf, default = (e["impls"][k] for k in ("ours_triton_recompute", "ours_triton_buffer", "ours_triton"))
        f = e["floor"]
        expected = {
            "v/tp": [e["vocab_local"]],
            "1 gemm ms": [f["gemm1_ms"]],
            "4 gemms ms": [f["gemm4_ms"]],
            "recompute fwd / 1 gemm": [rec["fwd_ratio"]],
            "no-grad fwd / 1 gemm": [rec["nograd_fwd_ms"] / f["gemm1_ms"]],
            "recompute fwd+bwd / 4 gemms": [rec["fwd_bwd_ratio"]],
            "buffer fwd / 1 gemm": [buf["fwd_ratio"]],
            "buffer fwd+bwd / 4 gemms": [buf["fwd_bwd_ratio"]],
            "default fwd / 1 gemm": [default["fwd_ratio"]],
            "default fwd+bwd / 4 gemms": [default["fwd_bwd_ratio"]],
            "recompute peak extra gib (grads)": [rec["peak_extra_gib"], e["output_grads_gib"]],
            "log-prob / entropy err": [rec["logp_rel_err"], rec["entropy_rel_err"]],
            "d_hidden / d_w err": [rec["dhidden_rel_err"], rec["dweight_rel_err"]],
        }
        assert set(expected) == set(row) - {"shape", "tp"}
        for name, values in expected.items():
            check_cells(row[name], values, f"head_h200.md {row['shape']} tp {row['tp']} {name}")


# head_h200.md's names for the sweeps' variants, where they differ from profile_head.py's.
SWEEP_LABELS = {
    "recompute (240 MiB dz workspace, TMA stores)": "recompute",
    "recompute, dz 2 vocab tiles per program": "recompute, dz 2 tiles/program",
    "recompute, dz 4 vocab tiles per program": "recompute, dz 4 tiles/program",
    "buffer (TMA stores)": "buffer",
    "buffer, dz pass 16 rows per program": "buffer, dz 16 rows",
    "buffer, dz pass 32 rows, 8 warps": "buffer, dz 32 rows 8 warps",
    "BLOCK_N 128, 4 warps (two programs per SM)": "BLOCK_N 128, 4 warps",
    "BLOCK_M 64, 4 warps, 2 stages (two programs per SM)": "BLOCK_M 64, 4 warps, 2 stages",
}


def test_head_sweep_tables_are_their_json():
    path = BENCH / "head_h200.md"
    for name, key, floor, section in (
        ("3_profile_sweep_forward.json", "nograd_fwd_ms", 1, "Forward tile configuration"),
        ("3_profile_sweep.json", "fwd_bwd_ms", 4, "Backward settings"),
    ):
        cases = load(f"gpu_runs/h200_2026-12-01c/{name}")["cases"]
        sweep = table(path, "variant", under=section)
        assert [h.split(" ms")[0] for h in sweep.header[1::2]] == [f"{c['shape']} TP {c['tp']}" for c in cases]
        assert sweep.rows
        for row in sweep.rows:
            variant = SWEEP_LABELS.get(row[0], row[0])
            for i, case in enumerate(cases):
                ms = case[key]
                assert variant in ms, f"head_h200.md {section}: {row[0]!r} is not a variant of {name}"
                check_cells(row[1 + 2 * i], [ms[variant]], f"{section} {row[0]} ms")
                check_cells(row[2 + 2 * i], [ms[variant] / (floor * ms["one GEMM"])], f"{section} {row[0]} ratio")

    liger = load("gpu_runs/h200_2026-12-01c/2_bench_head_liger_cutedsl.json")["results"]
    rows = table(path, "Liger no-grad fwd ms").dicts()
    assert len(rows) == len(liger)
    for row, e in zip(rows, liger, strict=True):
        o, lg = e["impls"]["ours_triton"], e["impls"]["liger_scaled_ce"]
        assert (row["shape"], row["tp"]) == (e["shape"], str(e["tp"]))
        for name, value in (
            ("1 gemm ms", e["floor"]["gemm1_ms"]),
            ("ours no-grad fwd ms", o["nograd_fwd_ms"]),
            ("liger no-grad fwd ms", lg["nograd_fwd_ms"]),
            ("ours entropy err", o["entropy_rel_err"]),
            ("liger entropy err", lg["entropy_rel_err"]),
        ):
            check_cells(row[name], [value], f"head_h200.md Liger {e['shape']} tp {e['tp']} {name}")


def test_teacher_table_is_its_json():
    results = {}
    for name in ("3_bench_distill.json", "3_bench_distill_v262144.json"):
        for r in load(f"gpu_runs/h200_2026-12-02e/{name}")["results"]:
            results[(r["vocab"], r["tp"], r["k"])] = r
    rows = teacher().dicts()
    assert len(rows) == len(results)
    for row in rows:
        r = results[(int(dec(row["v"])), int(row["tp"]), int(row["k"]))]
        gemm, triton, naive = (r["impls"][k] for k in ("gemm", "triton", "naive"))
        for name, value in (
            ("gemm gpu ms", gemm["gpu_median_ms"]),
            ("triton × gemm, gpu", triton["gpu_ratio_to_gemm"]),
            ("from idle", triton["ratio_to_gemm"]),
            ("naive × gemm", naive["gpu_ratio_to_gemm"]),
            ("triton peak gib", triton["peak_extra_gib"]),
            ("naive peak gib", naive["peak_extra_gib"]),
            ("full tiles per token", r["triton_candidates"]["full_per_row"]),
            ("ids = fp64", triton["ids_equal_fraction"]),
            ("max abs δ log p", triton["max_abs_logp_err"]),
        ):
            check_cells(
                row[name], [value], f"distillation_h200.md teacher {row['v']} tp {row['tp']} k {row['k']} {name}"
            )


def test_student_tables_are_their_sources():
    results = {r["tp"]: r for r in load("gpu_runs/h200_2026-12-01f/4_student/bench_distill_student.json")["results"]}
    rows = student("k = 64 (2026-12-01)").dicts()
    assert rows
    for row in rows:
        r = results[int(row["tp"])]["impls"][row["impl"]]
        for name, key in (
            ("ms", "median_ms"),
            ("× four-gemm floor", "ratio_to_gemm4"),
            ("peak extra gib", "peak_extra_gib"),
            ("log q rel err", "log_q_rel_err"),
            ("d_hidden rel err", "d_hidden_rel_err"),
        ):
            check_cells(row[name], [r.get(key)], f"distillation_h200.md student tp {row['tp']} {row['impl']} {name}")
    # The V = 262,144 table is bench_distill's own Markdown output, copied: the same rows.
    copied = student("V = 262,144").rows
    raw = table(BENCH / "gpu_runs" / "h200_2026-12-02" / "6_student_v262144.md", "impl").rows
    assert copied == raw


def test_ppo_tables_are_their_json():
    files = {
        "TP 1 (1 GPU)": "bench_ppo_tp1_cp1_mb8192.json",
        "TP 2 + SP": "bench_ppo_tp2_cp1_sp_mb8192.json",
        "TP 1 × CP 2 in the model": "bench_ppo_tp1_cp2_mb8192.json",
    }
    rows = ppo_step().dicts()
    assert {r["layout"] for r in rows} == set(files)
    for row in rows:
        v = load(f"multi_gpu/h200x2_2026-11-30/{files[row['layout']]}")["variants"]
        fused, logits = v["fused"], v["logits"]
        for name, values in (
            ("fused step (s)", [fused["median_step_s"]]),
            ("logits step (s)", [logits["median_step_s"]]),
            ("fused / logits", [fused["median_step_s"] / logits["median_step_s"]]),
            ("log-prob pass", [fused["median_logprob_s"] / logits["median_logprob_s"]]),
            ("updates", [fused["median_update_s"] / logits["median_update_s"]]),
        ):
            check_cells(row[name], values, f"multi_gpu PPO {row['layout']} {name}")
        peaks = numbers(row["peak memory fused / logits (gib)"])[:2]
        check(peaks[0], fused["peak_gib"], f"multi_gpu PPO {row['layout']} fused peak")
        check(peaks[1], logits["peak_gib"], f"multi_gpu PPO {row['layout']} logits peak")

    largest = load("multi_gpu/h200x2_2026-11-30/bench_ppo_max_micro_batch_tp1.json")["max_micro_batch"]
    for row, variant in zip(micro_batch().dicts(), ("fused", "logits"), strict=True):
        best = largest[variant]["largest"]
        check(numbers(row["largest micro-batch that fits"])[0], best["micro_batch_tokens"], f"{variant} largest")
        check(numbers(row["its step throughput"])[0], best["tokens_per_s"], f"{variant} throughput")
        check(numbers(row["peak at 32,768 tokens"])[0], largest[variant]["sizes"][0]["peak_gib"], f"{variant} peak")


def _longest(rows, col: str) -> str:
    fits = [r["sequence length"] for r in rows if "out of memory" not in r[col]]
    return max(fits, key=dec)


def test_long_context_table_is_its_json():
    lc = long_context()
    rows = lc.dicts()
    for vocab, label in ((151936, "V 151,936"), (248320, "V 248,320")):
        by_len = {
            r["seq_len"]: r for r in load(f"gpu_runs/h200_2026-12-01e/long_context_v{vocab}.json")["long_context"]
        }
        for variant, col in (("fused", f"{label} fused"), ("logits", f"{label} logits")):
            name = next(h.lower() for h in lc.header if h.lower().startswith(col.lower()))
            for row in rows:
                got = by_len[int(dec(row["sequence length"]))][variant]
                if got.get("oom"):
                    assert "out of memory" in row[name], f"long context {label} {variant} {row['sequence length']}"
                else:
                    check_cells(row[name], [got["step_s"], got["peak_gib"]], f"long context {label} {variant}")


VERL_RECORD = "gpu_runs/h200_2026-12-03b"
VERL_IMPLS = {"fused": "fused", "verl_logits": "verl_logits", "verl_chunked": "verl_chunked"}


def test_verl_distill_tables_are_their_json():
    """verl_distill_h200.md and its record's README: Σπ²'s cost, the distillation step and the
    longest sequence, cell by cell against the run's JSON."""
    pages = (BENCH / "verl_distill_h200.md", BENCH / VERL_RECORD / "README.md")
    sum_pi = {
        (e["shape"], str(e["tp"])): e["sum_pi_squared"]
        for e in load(f"{VERL_RECORD}/1_bench_head_sum_pi.json")["results"]
    }
    short = table(pages[0], "shape, tp", "no-grad forward ratio")
    full = table(pages[1], "shape, tp", "forward ms")
    assert len(short.rows) == len(full.rows) == len(sum_pi) == 4
    for row in short.rows:
        sp = sum_pi[tuple(x.strip() for x in row[0].split(","))]
        check_cells(" ".join(row[1:]), [sp["fwd_ratio"], sp["nograd_fwd_ratio"], sp["sum_pi_squared_rel_err"]], row[0])
    for row in full.rows:
        sp = sum_pi[tuple(x.strip() for x in row[0].split(","))]
        keys = ("fwd_ms", "fwd_sum_pi_squared_ms", "fwd_ratio", "nograd_fwd_ms", "nograd_fwd_sum_pi_squared_ms")
        check_cells(" ".join(row[1:7]), [sp[k] for k in keys] + [sp["nograd_fwd_ratio"]], row[0])
        assert row[7] == ("yes" if max(sp["fwd_ratio"], sp["nograd_fwd_ratio"]) <= 1.02 else "no"), row[0]
        check_cells(row[8], [sp["sum_pi_squared_rel_err"]], row[0])

    # The summary page shows the second call's step (the route as it is); the record both calls.
    step_tables = [
        (pages[0], None, "5_step", 8),
        (pages[1], "verl's top-k distillation step", "2_step", 10),
        (pages[1], "Second call", "5_step", 10),
    ]
    for page, under, folder, count in step_tables:
        steps = {str(r["tp"]): r for r in load(f"{VERL_RECORD}/{folder}/bench_verl_distill.json")["step"]}
        rows = table(page, "impl", "× four-GEMM floor", "peak GiB", under=under).dicts()
        assert len(rows) == count, (page.name, under)
        for row in rows:
            step, what = steps[row["tp"]], f"{page.name} TP {row['tp']} {row['impl']}"
            if row["impl"] in VERL_IMPLS:
                r = step[row["impl"]]
                values = [r["ms"], r["ratio_to_gemm4"], r["peak_gib"], r["kl_max_rel_vs_verl_logits"]]
            elif row["impl"] == "student's top-k pass alone":
                values = [step["student_topk_ms"], step["student_topk_ms"] / step["gemm4_ms"], None, None]
            else:
                assert row["impl"] == "four-GEMM floor", what
                values = [step["gemm4_ms"], 1.0, None, None]
            cells = [row["ms"], row["× four-gemm floor"], row["peak gib"], row["kl rel vs verl_logits"]]
            for cell, value in zip(cells, values, strict=True):
                check_cells(cell, [value], what)
            if "v shard" in row:
                check_cells(row["v shard"], [step["vocab_shard"]], what)

    longest = {r["impl"]: r for r in load(f"{VERL_RECORD}/4_longest/bench_verl_distill.json")["longest"]}
    for page in pages:
        rows = table(page, "route", "longest single sequence").dicts()
        assert [r["route"] for r in rows] == list(longest)
        for row in rows:
            r, what = longest[row["route"]], f"{page.name} longest {row['route']}"
            check_cells(row["longest single sequence"], [r["longest_fitting"]], what)
            if r["first_not_fitting"] is None:
                assert r["longest_fitting"] == r["capped_at"] and "cap" in row["longest single sequence"], what
                assert row["first not fitting"] == "not reached", what
            else:
                check_cells(row["first not fitting"], [r["first_not_fitting"]], what)


HOST_ROWS = {
    "no-grad forward": "nograd_forward_host_ms_steady",
    "forward that keeps the graph": "forward_host_ms_steady",
    "backward, the head's node": "backward_node_host_ms_steady",
    "backward, autograd's own (a no-op function's)": "autograd_noop_backward_ms_steady",
}


def host_work() -> dict[str, dict]:
    record = "gpu_runs/h200_2026-12-04"
    return {
        "tp 8 shard": json_in_log(f"{record}/4_host_work_C_qwen7b_tp8.log"),
        "tp 1": json_in_log(f"{record}/4_host_work_C_qwen7b_tp1.log"),
        "tp 8, graphed": json_in_log("gpu_runs/h200_2026-12-02d/3_host_work_tp8_graphed.log"),
    }


def test_megatron_host_work_table_is_its_json():
    runs = host_work()
    rows = table(REPO / "docs" / "megatron.md", "ms per call").dicts()
    assert {r["ms per call"].lower() for r in rows} == set(HOST_ROWS)
    for row in rows:
        for col, run in runs.items():
            key = HOST_ROWS[row["ms per call"].lower()]
            check_cells(row[col], [run[key]], f"megatron.md host work {row['ms per call']} {col}")


# ---------------------------------------------------------------------------------------------
# README.md

README_IMPLS = {
    "mcore_ppo, recompute": "ours_triton_recompute",
    "mcore_ppo, probability buffer": "ours_triton_buffer",
    "mcore_ppo, default (buffer in 1 GiB)": "ours_triton",
    "Liger 0.8.5 fused linear scaled CE": "liger_scaled_ce",
    "verl linear_cross_entropy": "verl_linear_ce",
    "naive + torch.compile (keeps logits)": "torch_compile",
}


def readme_results() -> str:
    body = text(REPO / "README.md")
    return body[body.index("\n## Results\n") : body.index("\n## Documentation\n")]


def readme_distillation() -> str:
    body = text(REPO / "README.md")
    start = body.index("**Distillation**")
    return body[start : body.index("\n\n", start)]


def test_readme_results_table_rows_are_bench_head_rows():
    readme = table(REPO / "README.md", "implementation", "fwd / one GEMM")
    source = bench_head()
    assert readme.rows
    for row in readme.dicts():
        impl = README_IMPLS[row["implementation"]]
        src = source.one(shape="qwen7b", tp=row["tp"], impl=impl)
        what = f"README results {row['implementation']} tp {row['tp']}"
        check_cells(row["fwd / one gemm"], numbers(src["fwd / 1 gemm"]), what)
        check_cells(row["fwd+bwd / four gemms"], numbers(src["fwd+bwd / 4 gemms"]), what)
        check_cells(row["peak extra gib (output grads)"], numbers(src["peak extra gib (grads)"]), what)
        errors = numbers(src["logp err"]) + numbers(src["entropy err"])
        check_cells(row["log-prob / entropy rel. err"], errors, what)


def test_readme_results_figures_come_from_the_tables():
    claims = Claims(re.sub(r"(?m)^\|.*\n", "", readme_results()), "README.md Results")
    report = load("bench_head.json")
    head = bench_head().dicts()
    vocabs = head_vocabs()

    m = claims.find(
        rf"One H200, bf16, (?P<n>{NUMBER}) tokens, T = (?P<t>{NUMBER}), per-rank shards of Qwen-7B's head "
        rf"\(h (?P<h>\d+), V (?P<v>\d+)\)"
    )
    qwen = next(e for e in report["results"] if e["shape"] == "qwen7b" and e["tp"] == 1)
    check(m["n"], report["args"]["tokens"], "tokens")
    check(m["t"], report["args"]["temperature"], "temperature")
    check(m["h"], qwen["hidden"], "hidden")
    check(m["v"], qwen["vocab_local"], "vocab")
    date = claims.find(r"\(`scripts/bench_head.py`, (\d{4}-\d\d-\d\d);")
    assert report["date"].startswith(date[1])
    assert "H200" in report["device"]
    liger_rows = [r[0] for r in table(REPO / "README.md", "implementation").rows if r[0].startswith("Liger")]
    assert liger_rows and all(r.startswith(f"Liger {report['versions']['liger-kernel']} ") for r in liger_rows)

    def rows(impl, tps=None):
        return [r for r in head if r["impl"] == impl and (tps is None or r["tp"] in tps)]

    m = claims.find(
        rf"the recompute's forward takes {RANGE}× one GEMM at TP 1–4 and "
        rf"(?P<lo8>{NUMBER})–(?P<hi8>{NUMBER})× at TP 8"
    )
    check_range(m, column(rows("ours_triton_recompute", {"1", "2", "4"}), "fwd / 1 GEMM"), "recompute forward TP 1-4")
    check_range(m, column(rows("ours_triton_recompute", {"8"}), "fwd / 1 GEMM"), "recompute forward TP 8", "lo8", "hi8")
    m = claims.find(rf"the default's, which also stores the probability buffer where it fits in 1 GiB, {RANGE}×")
    check_range(m, column(rows("ours_triton"), "fwd / 1 GEMM"), "default forward")
    m = claims.find(
        rf"At a 262k vocabulary the recompute's forward takes (?P<a>{NUMBER})× at TP 1 and (?P<b>{NUMBER})× at TP 8"
    )
    check(m["a"], vocabs.one(shape="v262k", tp=1)["recompute fwd / 1 gemm"], "262k TP 1")
    check(m["b"], vocabs.one(shape="v262k", tp=8)["recompute fwd / 1 gemm"], "262k TP 8")
    m = claims.find(rf"log-prob errors stay ≤ (?P<lp>{NUMBER}) and entropy errors ≤ (?P<ent>{NUMBER})")
    log_probs = column(ours(head), "logp err") + [numbers(r["log-prob / entropy err"])[0] for r in vocabs.dicts()]
    entropies = column(ours(head), "entropy err") + [numbers(r["log-prob / entropy err"])[1] for r in vocabs.dicts()]
    check(m["lp"], max(map(dec, log_probs)), "largest log-prob error")
    check(m["ent"], max(map(dec, entropies)), "largest entropy error")

    m = claims.find(
        rf"forward\+backward takes {RANGE}× the four-GEMM floor, against "
        rf"(?P<clo>{NUMBER})–(?P<chi>{NUMBER})× for `torch.compile` \(TP 1\)"
    )
    check_range(m, column(rows("ours_triton_buffer"), "fwd+bwd / 4 GEMMs"), "buffer forward+backward")
    check_range(m, column(rows("torch_compile"), "fwd+bwd / 4 GEMMs"), "torch.compile", "clo", "chi")
    assert {r["tp"] for r in rows("torch_compile")} == {"1"}

    m = claims.find(
        rf"PPO step of a 1.8B GPT \(vocab (?P<v>{NUMBER})\) the fused head takes (?P<tp1>{NUMBER})× the logits "
        rf"path's time at TP 1, (?P<tp2>{NUMBER})× at TP 2 \+ SP and (?P<cp2>{NUMBER})× at TP 1 × CP 2"
    )
    ppo = ppo_step()
    check(m["v"], load("multi_gpu/h200x2_2026-11-30/bench_ppo_tp1_cp1_mb8192.json")["model"]["vocab_size"], "PPO vocab")
    for group, layout in (("tp1", "TP 1 (1 GPU)"), ("tp2", "TP 2 + SP"), ("cp2", "TP 1 × CP 2 in the model")):
        check(m[group], ppo.one(layout=layout)["fused / logits"], f"PPO step {layout}")
    m = claims.find(rf"fits twice the micro-batch \((?P<f>{NUMBER}) tokens against (?P<l>{NUMBER})\)")
    fused, logits = (numbers(r["largest micro-batch that fits"])[0] for r in micro_batch().dicts())
    check(m["f"], fused, "largest fused micro-batch")
    check(m["l"], logits, "largest logits micro-batch")
    assert dec(fused) == 2 * dec(logits)

    m = claims.find(
        rf"longest single sequence there is (?P<f>{NUMBER}) tokens at V (?P<v1>{NUMBER}) and (?P<v2>{NUMBER}), "
        rf"against the logits path's (?P<l1>{NUMBER}) and (?P<l2>{NUMBER})"
    )
    lc = long_context()
    rows_lc = lc.dicts()
    for v, lg in (("v1", "l1"), ("v2", "l2")):
        label = f"V {m[v]}"
        fused_col = next((h.lower() for h in lc.header if h.startswith(f"{label} fused")), None)
        assert fused_col, f"long_context_tp1.md has no column for {label}"
        check(m["f"], _longest(rows_lc, fused_col), f"longest fused sequence at {label}")
        check(m[lg], _longest(rows_lc, f"{label} logits".lower()), f"longest logits sequence at {label}")

    assert not claims.unchecked(), f"README Results: figures no pattern checks: {claims.unchecked()}"


def test_readme_distillation_figures_come_from_the_tables():
    claims = Claims(readme_distillation(), "README.md Distillation")
    rows = teacher().dicts()
    m = claims.find(rf"\({RANGE}× one GEMM at TP 1, (?P<lo8>{NUMBER})–(?P<hi8>{NUMBER})× at TP 8\)")
    check_range(m, [r["triton × gemm, gpu"] for r in rows if r["tp"] == "1"], "teacher TP 1")
    check_range(m, [r["triton × gemm, gpu"] for r in rows if r["tp"] == "8"], "teacher TP 8", "lo8", "hi8")
    m = claims.find(rf"\(k (?P<k>\d+): (?P<a>{NUMBER})× / (?P<b>{NUMBER})× the four-GEMM floor at TP 1 / 8\)")
    results = load("gpu_runs/h200_2026-12-01f/4_student/bench_distill_student.json")["results"]
    assert {r["k"] for r in results} == {int(m["k"])}
    table_ = student("k = 64 (2026-12-01)")
    check(m["a"], table_.one(tp=1, impl="fused")["× four-gemm floor"], "student TP 1")
    check(m["b"], table_.one(tp=8, impl="fused")["× four-gemm floor"], "student TP 8")
    assert not claims.unchecked(), f"README Distillation: figures no pattern checks: {claims.unchecked()}"


# ---------------------------------------------------------------------------------------------
# docs/*.md


def test_kernels_measured_ranges_are_the_benchmark_table():
    """kernels.md's "Measured" ranges span head_h200.md's table at three vocabularies."""
    claims = Claims(text(REPO / "docs" / "kernels.md"), "docs/kernels.md")
    rows = head_vocabs().dicts()
    m = claims.find(
        rf"the forward takes {RANGE}× one GEMM \(no-grad: (?P<glo>{NUMBER})–(?P<ghi>{NUMBER})×\), forward\+backward "
        rf"(?P<rlo>{NUMBER})–(?P<rhi>{NUMBER})× the four-GEMM floor in recompute mode and "
        rf"(?P<blo>{NUMBER})–(?P<bhi>{NUMBER})× in buffer mode; log-prob errors are (?P<llo>{NUMBER})–"
        rf"(?P<lhi>{NUMBER}), entropy errors (?P<elo>{NUMBER})–(?P<ehi>{NUMBER})\."
    )
    check_range(m, column(rows, "recompute fwd / 1 GEMM"), "recompute forward")
    check_range(m, column(rows, "no-grad fwd / 1 GEMM"), "no-grad forward", "glo", "ghi")
    check_range(m, column(rows, "recompute fwd+bwd / 4 GEMMs"), "recompute forward+backward", "rlo", "rhi")
    check_range(m, column(rows, "buffer fwd+bwd / 4 GEMMs"), "buffer forward+backward", "blo", "bhi")
    errors = [numbers(row["log-prob / entropy err"]) for row in rows]
    check_range(m, [log_prob for log_prob, _ in errors], "log-prob error", "llo", "lhi")
    check_range(m, [entropy for _, entropy in errors], "entropy error", "elo", "ehi")


def test_kernels_figures_come_from_the_tables():
    claims = Claims(text(REPO / "docs" / "kernels.md"), "docs/kernels.md")
    head = bench_head().dicts()
    vocabs = head_vocabs().dicts()
    m = claims.find(
        rf"\({RANGE}× the four-GEMM floor, against (?P<rlo>{NUMBER})–(?P<rhi>{NUMBER})× for the recompute, "
        r"qwen7b and llama3-8b at TP 1–8\)"
    )
    check_range(m, column([r for r in head if r["impl"] == "ours_triton_buffer"], "fwd+bwd / 4 GEMMs"), "buffer")
    check_range(
        m,
        column([r for r in head if r["impl"] == "ours_triton_recompute"], "fwd+bwd / 4 GEMMs"),
        "recompute",
        "rlo",
        "rhi",
    )
    m = claims.find(rf"The buffer mode's forward with grad is {RANGE}× one GEMM")
    check_range(m, column(vocabs, "buffer fwd / 1 GEMM"), "buffer forward")
    m = claims.find(r"`d_hidden` / `d_W` errors are (?P<lo>\d\.\d)–(?P<hi>\d\.\d)(?P<exp>e-\d+)")
    grads = column(vocabs, "d_hidden / d_W err")
    check(m["lo"] + m["exp"], min(map(dec, grads)), "smallest gradient error")
    check(m["hi"] + m["exp"], max(map(dec, grads)), "largest gradient error")
    m = claims.find(
        rf"(?P<nograd>{NUMBER}) ms per no-grad forward, (?P<fwd>{NUMBER}) ms per forward, "
        rf"(?P<bwd>{NUMBER}) ms per backward node"
    )
    tp8 = host_work()["tp 8 shard"]
    check(m["nograd"], tp8["nograd_forward_host_ms_steady"], "no-grad forward host work")
    check(m["fwd"], tp8["forward_host_ms_steady"], "forward host work")
    check(m["bwd"], tp8["backward_node_host_ms_steady"], "backward node host work")

    profile = table(BENCH / "head_h200.md", "kernel", under="per-kernel profile").dicts()
    m = claims.find(
        rf"`stats_kernel` takes (?P<s>{NUMBER})× a cuBLAS GEMM of its shape and `dz_kernel` (?P<d>{NUMBER})×"
    )
    ratio = "× one gemm (2.687 ms)"
    check(m["s"], next(r for r in profile if r["kernel"] == "stats_kernel")[ratio], "stats_kernel")
    check(
        m["d"],
        next(r for r in profile if r["kernel"].endswith("dz_kernel") and "buffer" not in r["kernel"])[ratio],
        "dz_kernel",
    )
    sweep = table(BENCH / "head_h200.md", "variant", under="Forward tile configuration")
    ratios = {r[0]: [r[2], r[4]] for r in sweep.rows}
    m = claims.find(
        rf"`128 × 128` tiles with 4 warps {RANGE}× the GEMM, `64 × 256` with 2 stages "
        rf"(?P<blo>{NUMBER})–(?P<bhi>{NUMBER})×, against (?P<dlo>{NUMBER})–(?P<dhi>{NUMBER})×"
    )
    check_range(m, ratios["BLOCK_N 128, 4 warps (two programs per SM)"], "128 x 128, 4 warps")
    check_range(m, ratios["BLOCK_M 64, 4 warps, 2 stages (two programs per SM)"], "64 x 256", "blo", "bhi")
    check_range(m, ratios["default"], "default tiles", "dlo", "dhi")
    m = claims.find(rf"qwen7b TP 8 (?P<liger>{NUMBER}) vs (?P<ours>{NUMBER}) ms")
    liger = table(BENCH / "head_h200.md", "Liger no-grad fwd ms").one(shape="qwen7b", tp=8)
    check(m["liger"], liger["liger no-grad fwd ms"], "Liger no-grad forward")
    check(m["ours"], liger["ours no-grad fwd ms"], "our no-grad forward")


_TOPK_STAGES = ("select_top_kernel", "tile_rows_kernel", "full_pairs_kernel", "merge_full_kernel")


def _profile_ms(profile: str, kernel: str) -> float:
    """The first "Self CUDA" time of ``kernel`` in a torch.profiler table, in ms."""
    value, unit = re.search(rf"{kernel}(?:\s+\S+){{5}}\s+([\d.]+)(ms|us)", profile).groups()
    return float(value) / (1.0 if unit == "ms" else 1000.0)


def test_distillation_figures_come_from_the_tables():
    claims = Claims(text(REPO / "docs" / "distillation.md"), "docs/distillation.md")
    record = BENCH / "gpu_runs" / "h100_2026-12-07b"
    # bench_distill.md has "× GEMM" twice: from idle, then of the GPU time beside "GPU ms".
    runs = table(record / "6_bench_distill.md", "impl", "GPU ms")
    gpu_ratio, impl, tp, k = (runs.col(name) for name in ("GPU ms", "impl", "tp", "k"))
    default = [row for row in runs.rows if row[impl] == "triton"]
    m = claims.find(
        rf"the top-k in the head's statistics pass took {RANGE}× one GEMM at TP 1 and "
        rf"(?P<lo8>{NUMBER})–(?P<hi8>{NUMBER})× at the TP 8 shard \(k (?P<k1>\d+)–(?P<k2>\d+), the default"
    )
    check_range(m, [row[gpu_ratio + 1] for row in default if row[tp] == "1"], "top-k TP 1")
    check_range(m, [row[gpu_ratio + 1] for row in default if row[tp] == "8"], "top-k TP 8", "lo8", "hi8")
    assert (int(m["k1"]), int(m["k2"])) == (min(int(r[k]) for r in default), max(int(r[k]) for r in default))

    m = claims.find(
        rf"at TP 1, k 128 with 3 candidates the statistics kernel alone took (?P<stats>{NUMBER}) ms against the "
        rf"GEMM's (?P<gemm>{NUMBER}) \(two token chunks\), the selection, recompute, listing and merge "
        rf"(?P<rest>{NUMBER}) ms more"
    )
    profile = text(record / "2_distill.log")
    tp1_k128 = profile[profile.index("tp 1 k 128") :]
    own = {name: _profile_ms(tp1_k128, name) for name in ("stats_kernel", *_TOPK_STAGES)}
    check(m["stats"], own.pop("stats_kernel"), "stats kernel, TP 1, k 128")
    check(m["rest"], sum(own.values()), "selection, recompute, listing and merge, TP 1, k 128")
    first = table(record / "2_bench_distill.md", "impl", "GPU ms")
    check(m["gemm"], next(r for r in first.rows if r[impl] == "gemm" and r[k] == "128" and r[tp] == "1")[gpu_ratio],
          "GEMM at TP 1, k 128")  # fmt: skip

    m = claims.find(
        rf"As rank 0 of a TP 8 group on one GPU \(the ranks' merge included, no all-gather\) it took {RANGE}× "
        rf"for k (?P<k1>\d+)–(?P<k2>\d+)"
    )
    ratios, ks = [], []
    for visit in ("C1", "C2"):  # the tree's two visits in that record (A C C A)
        ranked = table(BENCH / "gpu_runs" / "h100_2026-12-07c" / f"7_bench_distill_{visit}.md", "impl", "GPU ms")
        for row in ranked.rows:
            if row[ranked.col("impl")] == "triton_rank":
                ratios.append(row[ranked.col("GPU ms") + 1])
                ks.append(int(row[ranked.col("k")]))
    check_range(m, ratios, "top-k as rank 0 of TP 8")
    assert (int(m["k1"]), int(m["k2"])) == (min(ks), max(ks))

    # The candidates the rule chooses for a 152k vocab (594 tiles of 256 at TP 1, 75 at TP 8).
    m = claims.find(
        r"152k vocab that is (?P<c1>\d+ / \d+ / \d+) at TP 1 \(594 tiles\) for `k` 8 / 64 / 128, and "
        r"(?P<c8>\d+ / \d+ / \d+) at TP 8 \(75 tiles\)"
    )
    from mcore_ppo.distill.topk_config import DEFAULT_CONFIG, candidates_per_tile

    for group, tiles in (("c1", 594), ("c8", 75)):
        chosen = " / ".join(str(candidates_per_tile(tiles, top, DEFAULT_CONFIG)) for top in (8, 64, 128))
        assert m[group] == chosen, f"candidates at {tiles} tiles: the text says {m[group]}, the rule gives {chosen}"

    m = claims.find(
        rf"at k = 64 is (?P<a>{NUMBER})× the four-GEMM floor at TP 1 and (?P<b>{NUMBER})× at TP 8 "
        rf"\((?P<c>{NUMBER})× at both for V = 262,144\)"
    )
    k64 = student("k = 64 (2026-12-01)")
    check(m["a"], k64.one(tp=1, impl="fused")["× four-gemm floor"], "student TP 1")
    check(m["b"], k64.one(tp=8, impl="fused")["× four-gemm floor"], "student TP 8")
    big = student("V = 262,144")
    for tp in (1, 8):
        check(m["c"], big.one(tp=tp, impl="fused")["× four-gemm floor"], f"student V 262,144 TP {tp}")


def test_megatron_host_work_figure():
    claims = Claims(text(REPO / "docs" / "megatron.md"), "docs/megatron.md")
    m = claims.find(rf"\((?P<alone>{NUMBER}) ms per forward at TP 8\)")
    check(m["alone"], host_work()["tp 8 shard"]["forward_host_ms"], "forward timed alone at TP 8")


# ---------------------------------------------------------------------------------------------
# Links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = heading.strip().lower().replace("`", "")
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", heading))


@cache
def anchors(path: Path) -> frozenset[str]:
    body = re.sub(r"(?ms)^```.*?^```", "", text(path))
    return frozenset(_slug(h) for h in re.findall(r"(?m)^#{1,6} (.+)$", body))


def _expand(pattern: str) -> list[str]:
    """Brace alternatives as the shell expands them: a{b,c} -> ab, ac."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m[1].split(",") for x in _expand(pattern[: m.start()] + alt + pattern[m.end() :])]


def _exists(base: Path, target: str) -> bool:
    for path in _expand(target):
        if not any(base.glob(path)) if any(c in path for c in "*?[") else not (base / path).exists():
            return False
    return True


DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
BENCH_DOCS = sorted(BENCH.rglob("*.md"))


@pytest.mark.parametrize("path", DOCS + BENCH_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_markdown_links_resolve(path):
    body = re.sub(r"(?ms)^```.*?^```", "", text(path))
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", body):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{path.relative_to(REPO)}: broken links {broken}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_quoted_benchmark_paths_exist(path):
    """`docs/benchmarks/...` paths quoted in code spans name files or folders that exist."""
    quoted = re.findall(r"`(docs/benchmarks/[^`\s]*)`", text(path))
    missing = [q for q in quoted if not _exists(REPO, q)]
    assert not missing, f"{path.relative_to(REPO)}: {missing}"


@pytest.mark.parametrize("path", BENCH_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_benchmark_records_name_files_that_exist(path):
    """In docs/benchmarks/, a code span that names a results file (relative to the page, a folder
    the page names, or docs/benchmarks/) names one that exists; a bare file name may live in any
    record folder."""
    missing = []
    for quoted in re.findall(r"`([^`\s]+\.(?:json|log|md|png|txt))`", text(path)):
        if quoted.startswith(("docs/", "tests/", "scripts/", "mcore_ppo", "configs/", "/")):
            base = REPO
        else:
            base = path.parent
        if "/" not in quoted.replace("../", ""):
            if not any(
                _exists(folder, quoted) for folder in (base, BENCH, *(p.parent for p in BENCH_DOCS))
            ) and not any(BENCH.rglob(quoted)):
                missing.append(quoted)
        elif not (_exists(base, quoted) or _exists(BENCH, quoted)):
            missing.append(quoted)
    assert not missing, f"{path.relative_to(REPO)}: no such files {missing}"


RESULT_SUFFIXES = {".json", ".log", ".md", ".png", ".tsv", ".txt"}


def test_benchmark_folder_holds_results_only():
    """docs/benchmarks/ holds results (tables, logs, JSON, figures); scripts, diffs and code live
    in scripts/ and git's history, not beside the numbers."""
    files = (p for p in BENCH.rglob("*") if p.is_file())
    others = sorted(str(p.relative_to(BENCH)) for p in files if p.suffix not in RESULT_SUFFIXES)
    assert not others, f"docs/benchmarks/ holds non-result files: {others}"


def test_verl_main_ppo_table_is_its_json():
    """The on/off table of verl's trainer on the CPU, in its record and in docs/integrations.md,
    is the one its metrics.json makes (``mcore_ppo_testing.verl_cpu.record.markdown_table``)."""
    from mcore_ppo_testing.verl_cpu.record import markdown_table

    folder = BENCH / "verl_main_ppo_cpu"
    record = json.loads(text(folder / "metrics.json"))
    table = markdown_table(record["on_vs_off"])
    for page in (folder / "README.md", REPO / "docs" / "integrations.md"):
        assert table in text(page), f"{page.relative_to(REPO)}: not the table of {folder.name}/metrics.json"
    assert all(record["bit_identical"].values()), record["bit_identical"]


def test_precision_tables_are_their_json():
    """The numerics tables, in their record and on the summary page, are the ones their JSON
    makes (``mcore_ppo_testing.precision_tables``)."""
    from mcore_ppo_testing.precision_tables import mismatch_table, precision_table, sweep_table, tiles_sweep_table

    record = "gpu_runs/h200_2026-12-03f"
    precision, mismatch = load(f"{record}/bench_precision.json"), load(f"{record}/bench_mismatch.json")
    tiles = load("gpu_runs/h200_2026-12-04/1_bench_precision_sweep.json")
    pages = {
        BENCH / record / "README.md": (precision_table(precision), sweep_table(precision), mismatch_table(mismatch)),
        BENCH / "gpu_runs/h200_2026-12-04/README.md": (precision_table(tiles), tiles_sweep_table(tiles)),
    }
    pages[BENCH / "precision_h200.md"] = (*pages[BENCH / record / "README.md"], tiles_sweep_table(tiles))
    for page, tables in pages.items():
        for made in tables:
            assert made in text(page), f"{page.relative_to(REPO)}: not the table its JSON makes:\n{made}"
