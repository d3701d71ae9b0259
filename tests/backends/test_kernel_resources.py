"""The GEMM kernels, at the backend's default GPU configs, compiled for Hopper (sm_90) on any
machine, and their shared memory within what an H100/H200 gives one block.

Why: Triton sizes a kernel's shared memory at compile time; a change that adds operand stages
(a second pipelined K loop, a deeper ring, a staging tile) compiles fine in the CPU interpreter
and only fails on a GPU, at launch (``OutOfResources: shared memory``; it happened: 360 KB
asked of 227 KB, docs/kernels.md). Triton's compiler and ``ptxas`` come with the triton wheel,
so the real compile runs here, in a subprocess without the interpreter and with a stand-in
driver that names the target and launches nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

HOPPER_SHARED_BYTES = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 (227 KiB)

# A stand-in driver naming sm_90, and the two GEMM kernels' compiles at a forward config ``f``
# / backward config ``b``: their shared memory in bytes. Operands of ``dtype``, TMA operands,
# the forward's descriptors built in the kernel (plain pointers), ``dz_kernel``'s on the host.
PRELUDE = textwrap.dedent(
    """
    import dataclasses, json, sys, torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver


    class HopperTarget:  # what JITFunction asks of a driver before it launches anything
        def get_current_target(self): return GPUTarget("cuda", 90, 64)
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_active_torch_device(self): return torch.device("cpu")


    driver.set_active(HopperTarget())
    from triton.tools.tensor_descriptor import TensorDescriptor
    from mcore_ppo.backends.triton_backend import TritonBackend, TritonConfig
    from mcore_ppo.backends.triton_config import GPU_BACKWARD, GPU_FORWARD
    from mcore_ppo.backends.triton_host import for_dtype
    from mcore_ppo.kernels import dz_kernel, stats_kernel
    from mcore_ppo.statistics import Statistics

    n, h, v, chunk = 1024, 3584, 19008, 7680
    ints = torch.empty(n, dtype=torch.int32)
    count = torch.empty(1, dtype=torch.int32)
    labels = torch.empty(n, dtype=torch.int64)
    vec = torch.empty(n)


    def stats_compiled(f, dtype, store, buf_tma, num_stages, dot, **flags):
        x, w = torch.empty(n, h, dtype=dtype), torch.empty(v, h, dtype=dtype)
        splits, tiles = triton.cdiv(v, f.tiles_per_split * f.block_n), triton.cdiv(v, f.block_n)
        buf = torch.empty(n, v, dtype=dtype) if store else vec
        tmax = torch.empty(n, tiles) if store else vec
        kernel = stats_kernel.warmup(
            x, x, w, ints, count, labels, torch.empty(4, splits, n), vec, buf, tmax, n, v, h, h, h, splits, 1.0,
            tiles, vec, vec, ints, vec, vec, vec, BLOCK_M=f.block_m, BLOCK_N=f.block_n, BLOCK_K=f.block_k,
            TILES_PER_SPLIT=f.tiles_per_split,
            GROUP_M=f.group_m, num_warps=f.num_warps, num_stages=num_stages, USE_TMA=True, STORE_P=store,
            BUF_TMA=buf_tma, DIRECT_ROWS=True, EVEN_K=True, UPCAST=False, DOT=dot, grid=(1,), **flags,
        )
        return kernel


    def stats_shared(*args, **flags):
        return stats_compiled(*args, **flags).metadata.shared


    def dz_shared(b, dtype, dz_tma, num_stages, dot, **flags):
        x, w, dz = torch.empty(n, h, dtype=dtype), torch.empty(v, h, dtype=dtype), torch.empty(n, chunk, dtype=dtype)
        kernel = dz_kernel.warmup(
            x, w, TensorDescriptor.from_tensor(x, [b.block_m, b.block_k]),
            TensorDescriptor.from_tensor(w, [b.block_n, b.block_k]), ints, count, labels, vec, vec, vec, vec,
            dz, TensorDescriptor.from_tensor(dz, [b.block_m, b.block_n]), n, chunk, 0, h, h, h, chunk, 1.0, vec,
            vec, vec,
            **{"HAS_G": True, "HAS_E": True, **flags}, BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k,
            GROUP_M=b.group_m, num_warps=b.num_warps, num_stages=num_stages, USE_TMA=True, DZ_TMA=dz_tma,
            EVEN_K=True, UPCAST=False, DOT=dot, grid=(1,),
        )
        return kernel.metadata.shared
    """
)

COMPILE = PRELUDE + textwrap.dedent(
    """
    # The default backend outside the interpreter: the GPU configs, the forward's tiles per
    # split by shard (a loop count; the shared memory does not depend on it).
    backend = TritonBackend()
    assert backend.backward_config == GPU_BACKWARD and backend.tiles_by_shard
    f = backend.forward_config_for(v)
    assert f.use_tma and f == dataclasses.replace(GPU_FORWARD, tiles_per_split=f.tiles_per_split)
    shared = {}
    # The default variant, and the per-token temperature / entropy-off variants beside it.
    statistics = {" no_u": Statistics.named([]), " with_q": Statistics.named(["entropy", "sum_pi_squared"])}
    variants = {"": {}, " row_temp": {"ROW_TEMP": True}, **{k: s.kernel_options() for k, s in statistics.items()}}
    for store in (False, True):
        stages = min(f.num_stages, 3) if store else f.num_stages
        for suffix, flags in variants.items():
            name = ("stats_kernel buffer" if store else "stats_kernel") + suffix
            shared[name] = stats_shared(f, torch.bfloat16, store, store, stages, "native", **flags)
    # The teacher's top-k on the same kernel (TOPK_C candidates per tile) at the top-k's tiles,
    # alone and beside the entropy and Σπ² (verl's student with both on).
    from mcore_ppo.distill.topk_config import GPU_TILES
    for c in (3, 5):
        for suffix, s in {"": Statistics.named([]), " with_u_q": statistics[" with_q"]}.items():
            shared[f"stats_kernel topk c{c}{suffix}"] = stats_shared(
                GPU_TILES, torch.bfloat16, False, False, GPU_TILES.num_stages, "native", TOPK_C=c, **s.kernel_options()
            )
    b = backend.backward_config
    for suffix, flags in {"": {}, " row_temp": {"ROW_TEMP": True}, " no_e": {"HAS_E": False}}.items():
        shared["dz_kernel" + suffix] = dz_shared(b, torch.bfloat16, True, min(b.num_stages, 3), "native", **flags)
    print(json.dumps(shared))
    """
)


COMPILE_FP32 = PRELUDE + textwrap.dedent(
    """
    # fp32 operands under the default tiles: their dot's (FP32_TILES). IEEE dots: K halved by
    # for_dtype; fp32 buffer and dz tiles are stored through pointers (no TMA store).
    # fp32_faithful: the GEMMs read the inputs' fp16 parts with PARTS (no buffer).
    shared = {}
    backend = TritonBackend(TritonConfig(precision="ieee"))
    f = for_dtype(backend.forward_config_for(v, torch.float32), torch.float32)
    b = for_dtype(backend.backward_config_for(torch.float32), torch.float32)
    for store in (False, True):
        name = "ieee stats_kernel" + (" buffer" if store else "")
        shared[name] = stats_shared(f, torch.float32, store, False, f.num_stages, "ieee")
    shared["ieee dz_kernel"] = dz_shared(b, torch.float32, False, b.num_stages, "ieee")
    backend = TritonBackend(TritonConfig(precision="fp32_faithful"))
    f, b = backend.forward_config_for(v, torch.float32), backend.backward_config_for(torch.float32)
    shared["fp16x3 stats_kernel"] = stats_shared(f, torch.float16, False, False, f.num_stages, "native", PARTS=True)
    shared["fp16x3 dz_kernel"] = dz_shared(b, torch.float16, False, b.num_stages, "native", PARTS=True)
    print(json.dumps(shared))
    """
)


def test_fp32_default_gemm_kernels_fit_hopper_shared_memory():
    """The fp32 operands' default tiles (``triton_config.FP32_TILES``: IEEE dots, and the fp16
    parts of ``fp32_faithful``), stats_kernel (with and without the probability buffer for
    IEEE dots) and dz_kernel, compiled for sm_90."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FP32], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(shared) == {
        *(f"ieee {k}" for k in ("stats_kernel", "stats_kernel buffer", "dz_kernel")),
        "fp16x3 stats_kernel",
        "fp16x3 dz_kernel",
    }
    print(shared)
    too_big = {name: size for name, size in shared.items() if size > HOPPER_SHARED_BYTES}
    assert not too_big, f"over {HOPPER_SHARED_BYTES} bytes of shared memory on sm_90: {too_big}"
    assert all(size > 8 * 1024 for size in shared.values())  # the operand tiles are staged there


def test_default_gemm_kernels_fit_hopper_shared_memory():
    """stats_kernel (statistics only, and with the probability buffer's TMA store) and
    dz_kernel (with its TMA store) at the default tiles and stages, bf16, TMA operands; each
    also with a per-token temperature (ROW_TEMP), with the entropy off (U_PLANE 0 / HAS_E off)
    and, for stats_kernel, with Σπ²'s q sums (Q_PLANE); stats_kernel with the teacher's top-k
    (TOPK_C) at the top-k's tiles, with and without the entropy and Σπ²."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    stats = {
        f"stats_kernel{buffer}{flag}" for buffer in ("", " buffer") for flag in ("", " row_temp", " no_u", " with_q")
    }
    topk = {f"stats_kernel topk c{c}{suffix}" for c in (3, 5) for suffix in ("", " with_u_q")}
    assert set(shared) == stats | topk | {"dz_kernel", "dz_kernel row_temp", "dz_kernel no_e"}
    print(shared)
    too_big = {name: size for name, size in shared.items() if size > HOPPER_SHARED_BYTES}
    assert not too_big, f"over {HOPPER_SHARED_BYTES} bytes of shared memory on sm_90: {too_big}"
    assert all(size > 64 * 1024 for size in shared.values())  # the operand stages are really there


SPILLS = PRELUDE + textwrap.dedent(
    """
    # ptxas's own report (-v) on the PTX of each compile: bytes spilled per thread.
    import re, subprocess, tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    from mcore_ppo.distill.topk_config import GPU_TILES


    def spilled(f, dtype=torch.bfloat16, **flags):
        kernel = stats_compiled(f, dtype, False, False, f.num_stages, "native", **flags)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(kernel.asm["ptx"])
            ptx.flush()
            report = subprocess.run(
                [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx.name, "-o", "/dev/null"],
                capture_output=True, text=True, check=True,
            ).stderr
        return int(re.search(r"(\\d+) bytes spill stores", report)[1])


    backend = TritonBackend()
    spills = {"stats_kernel": spilled(backend.forward_config_for(v))}
    with_u_q = Statistics.named(["entropy", "sum_pi_squared"]).kernel_options()
    for c in (3, 5):
        spills[f"topk c{c}"] = spilled(GPU_TILES, TOPK_C=c, **Statistics.named([]).kernel_options())
        spills[f"topk c{c} with_u_q"] = spilled(GPU_TILES, TOPK_C=c, **with_u_q)
    # fp32_faithful: the fp32 inputs' fp16 parts, the promoted slice's product beside the tile.
    faithful = TritonBackend(TritonConfig(precision="fp32_faithful")).forward_config_for(v, torch.float32)
    spills["fp16x3 stats_kernel"] = spilled(faithful, torch.float16, PARTS=True)
    print(json.dumps(spills))
    """
)


def test_statistics_kernel_with_the_topk_keeps_its_registers():
    """stats_kernel at the head's default tiles, on fp32_faithful's fp16 parts at its tiles, and
    with the top-k (TOPK_C 3 and 5, alone and beside the entropy and Σπ²) at the top-k's tiles,
    compiled for sm_90: ptxas spills no
    register (the candidates are taken out of the tile in place, the pass has no labels: one
    tile of fp32 registers, as the statistics alone; a spill in the epilogue costs every tile)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", SPILLS], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    spills = json.loads(done.stdout.strip().splitlines()[-1])
    print(spills)
    assert set(spills) == {
        "stats_kernel",
        "fp16x3 stats_kernel",
        *(f"topk c{c}{s}" for c in (3, 5) for s in ("", " with_u_q")),
    }
    assert spills == dict.fromkeys(spills, 0), f"register spills on sm_90 (bytes per thread): {spills}"


TOPK_LAUNCHES = PRELUDE + textwrap.dedent(
    """
    # Every launch of the teacher's top-k, made by its own host code on CPU tensors (no data is
    # read on the host: the launches depend on shapes only), each compiled for sm_90 instead of
    # launched: the statistics kernel with TOPK_C, the selection, the full tiles' listing,
    # recompute and merge, and the ranks' merge by the selection kernel.
    from mcore_ppo.distill import topk_triton
    from mcore_ppo.distill.topk_config import DEFAULT_CONFIG

    compiled = []


    class CompileOnly:
        def bound(self):
            return self

        def __call__(self, kernel, grid, args, kwargs, site=None):
            compiled.append((kernel.fn.__name__, kernel.warmup(*args, grid=grid, **kwargs).metadata.shared))


    topk_triton._LAUNCHER = CompileOnly()
    h = 3584
    tokens = torch.empty(300, h, dtype=torch.bfloat16)
    head = Statistics.named(["entropy", "sum_pi_squared"])
    for v, k, statistics in ((151936, 8, None), (151936, 128, None), (18992, 8, head), (18992, 128, None)):
        topk_triton.shard_topk_triton(
            tokens, torch.empty(v, h, dtype=torch.bfloat16), k, 1.0, vocab_start=0, config=DEFAULT_CONFIG,
            statistics=statistics,
        )
    for world, k in ((8, 8), (2, 64), (8, 128)):
        # As the all-gather leaves them: [world, 2, n, k], fp32 values beside their ids' int32 bits.
        gathered = torch.empty(world, 2, 300, k).permute(1, 2, 0, 3)
        topk_triton.select_merged(gathered[0], gathered[1].view(torch.int32), k)
    print(json.dumps(compiled))
    """
)


def test_topk_kernels_compile_for_hopper_at_their_launches():
    """The teacher's top-k as its host code launches it (TP 1 and the TP 8 shard of a 152k vocab,
    k 8 and 128: 1, 2 and 5 candidates per tile; with the head's entropy and Σπ²; the ranks'
    merge of 8 ranks at k 8 and 128 and of 2 at k 64), every kernel compiled for sm_90 within
    Hopper's shared memory. The interpreter runs none of Triton's GPU lowering: a kernel it runs
    may still fail to compile for a GPU. (This compiles with the installed Triton; a compiler
    bug of another version shows only on a machine that has it.)"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", TOPK_LAUNCHES], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    names = {name for name, _ in compiled}
    assert names >= {"stats_kernel", "select_top_kernel", "full_pairs_kernel", "tile_rows_kernel", "merge_full_kernel"}
    assert sum(name == "select_top_kernel" for name, _ in compiled) >= 7  # 4 shard passes, 3 ranks' merges
    too_big = {name: size for name, size in compiled if size > HOPPER_SHARED_BYTES}
    assert not too_big, f"over {HOPPER_SHARED_BYTES} bytes of shared memory on sm_90: {too_big}"
