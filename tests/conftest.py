"""Single-process suite setup.

Triton's interpreter must be chosen before ``mcore_ppo.kernels`` is first imported (Triton
decides at decoration time), and any test module may import it first (through the backend
registry), so on a machine without CUDA it is switched on here, before collection. Only the
``triton`` backend's kernels are affected: ``backend="auto"`` still picks the torch backend
for CPU tensors.

Seeds: the tests' random data comes from :func:`mcore_ppo_testing.seeds.next_seed`, which
hands each test the seeds ``S, S + 1, ...`` in the order it draws them and prints each one.
``S`` is the environment variable ``MCORE_PPO_TEST_SEED`` (default 1234, as in the distributed
suite), so a run is reproducible, and a failure is replayed with the ``MCORE_PPO_TEST_SEED=...``
its captured output shows; another value draws new data.
"""

import contextlib
import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist

from mcore_ppo_testing import card_share, gpu_memory, megatron_tracker, seeds

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed_sequence():
    """Every test's seed sequence starts at MCORE_PPO_TEST_SEED (module doc)."""
    seeds.start_test()


@pytest.fixture(autouse=True)
def _fresh_backends():
    """Backends resolved by name are cached per process; tests patch their module defaults and
    the environment, so each test resolves them afresh."""
    from mcore_ppo.backends import clear_backend_cache

    clear_backend_cache()
    yield
    clear_backend_cache()


@pytest.fixture(autouse=True)
def _fresh_mtp_tracker():
    """Megatron keeps its MTP losses in a class-level dict (``MTPLossLoggingHelper.tracker``)
    whose tensors are sized by the first model's MTP depth: a later model with more MTP layers
    in the same process (an xdist worker) would index past them. Each test starts without it."""
    megatron_tracker.clear_mtp_tracker()
    yield


# Each test's peak of allocated GPU memory in this process: (GiB, test id) (gpu_memory).
_GPU_PEAKS: list[tuple[float, str]] = []


# The card, shared by the workers of a GPU machine (card_share.CardShare); None without CUDA.
_CARD = card_share.CardShare() if torch.cuda.is_available() else None


@pytest.fixture(autouse=True)
def _gpu_memory(request):
    """The test's GPU memory peak recorded, and its process's cached blocks given back after it
    (mcore_ppo_testing.gpu_memory); nothing where CUDA is not initialised. On a GPU machine the
    test holds the card, alone when it is marked ``gpu_heavy``."""
    card = (
        contextlib.nullcontext()
        if _CARD is None
        else _CARD.for_test(alone=request.node.get_closest_marker(card_share.HEAVY) is not None)
    )
    with card:
        gpu_memory.start_test()
        yield
        gpu_memory.end_test(request.node.nodeid, _GPU_PEAKS)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``).

    The tests use tiny shapes, where a second OpenMP/MKL thread only adds synchronisation; on the
    2 busy CI cores its spinning workers cost ~2.5× the CPU time and ~9× the wall time (measured:
    17 s vs 44 s user for the reference matrix).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_tp1():
    """A one-rank process group and Megatron parallel_state (TP 1), plus the CPU shims on CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_ppo_testing.cpu_shims import cpu_shims

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    shims = cpu_shims() if not torch.cuda.is_available() else contextlib.nullcontext()
    with shims:
        parallel_state.initialize_model_parallel(1, create_gloo_process_groups=False)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if created:
                dist.destroy_process_group()


@pytest.fixture(scope="module")
def fork_server():
    """``fork_server(*modules)``: a :class:`~mcore_ppo_testing.fork_server.ForkServer` that has
    imported ``modules`` (one per set of modules, for the test module): fresh processes that do
    not each pay torch's and Megatron's imports."""
    from mcore_ppo_testing.fork_server import ForkServer

    servers: dict[tuple[str, ...], ForkServer] = {}
    with contextlib.ExitStack() as stack:

        def get(*modules: str) -> ForkServer:
            if modules not in servers:
                servers[modules] = stack.enter_context(ForkServer(modules))
            return servers[modules]

        yield get


@pytest.fixture
def gloo_world(tmp_path):
    """A one-rank gloo process group for the test (file rendezvous: no port)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def test_seed() -> int:
    """The test's first seed (:func:`mcore_ppo_testing.seeds.next_seed`), with torch's global RNG
    seeded from it too, for tests whose data is drawn by library helpers from the global RNG."""
    seed = seeds.next_seed()
    torch.manual_seed(seed)
    return seed


# Reports of the run (error tables): titled blocks printed in the terminal summary, after the
# progress output, instead of between its dots.
_SUMMARY_SECTIONS: dict[str, list[str]] = {}


@pytest.fixture(scope="session")
def summary_section():
    """``summary_section(title, lines)``: show ``lines`` under ``title`` at the end of the run
    (the same title again replaces its lines)."""

    def add(title: str, lines: list[str]) -> None:
        _SUMMARY_SECTIONS[title] = list(lines)

    return add


def pytest_collection_modifyitems(config, items) -> None:
    """On a GPU machine the tests that need the card to themselves run last (card_share.heavy_last)."""
    if _CARD is not None:
        card_share.heavy_last(items)


def pytest_terminal_summary(terminalreporter) -> None:
    if _GPU_PEAKS:
        terminalreporter.section("largest GPU memory peaks (allocated, per test)")
        for line in gpu_memory.largest_peaks(_GPU_PEAKS):
            terminalreporter.write_line(line)
    for title, lines in _SUMMARY_SECTIONS.items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session) -> None:
    # Under pytest-xdist each worker ran some modules: hand their sections to the controller,
    # which prints the summary (scripts/test.sh runs with --dist loadfile, so a module's
    # report is whole on one worker).
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["mcore_ppo_summary_sections"] = dict(_SUMMARY_SECTIONS)
        workeroutput["mcore_ppo_gpu_peaks"] = list(_GPU_PEAKS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: a worker's report sections join this process's."""
    output = getattr(node, "workeroutput", {})
    _SUMMARY_SECTIONS.update(output.get("mcore_ppo_summary_sections", {}))
    _GPU_PEAKS.extend(tuple(peak) for peak in output.get("mcore_ppo_gpu_peaks", []))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    # The run is over; what is left is the interpreter's shutdown, whose garbage collections walk
    # every object torch, Megatron, Triton and the tests left behind: 3 to 4 s of CPU per pytest
    # process (each xdist worker, each rank of the multi-rank suite). Frozen objects are skipped by
    # those collections (they are still freed by reference counting); nothing runs after this but
    # pytest's return and the interpreter's exit. Measured: exit 3.5 s -> 0.3 s.
    gc.freeze()
