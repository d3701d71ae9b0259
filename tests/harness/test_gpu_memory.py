"""mcore_ppo_testing.gpu_memory: the summary of the tests' GPU memory peaks, and nothing done
(no CUDA initialised) in a process that has not initialised CUDA."""

from __future__ import annotations

import torch

from mcore_ppo_testing import gpu_memory


def test_the_largest_peaks_come_first_and_are_cut_at_top():
    peaks = [(1.5, "b"), (30.25, "c"), (0.0, "a"), (30.25, "a2"), (7.0, "d")]
    assert gpu_memory.largest_peaks(peaks, top=3) == [
        "  30.25 GiB  a2",
        "  30.25 GiB  c",
        "   7.00 GiB  d",
    ]
    assert gpu_memory.largest_peaks([]) == []
    assert len(gpu_memory.largest_peaks([(float(i), str(i)) for i in range(40)])) == gpu_memory.TOP


def test_nothing_is_recorded_or_initialised_without_cuda_in_use():
    if torch.cuda.is_initialized():  # a GPU worker where an earlier test used CUDA
        peaks: list = []
        gpu_memory.start_test()
        kept = torch.empty(1 << 20, device="cuda")
        gpu_memory.end_test("this test", peaks)
        assert peaks and peaks[0][1] == "this test" and peaks[0][0] >= 4 / 1024  # 4 MiB
        del kept
        return
    peaks = []
    gpu_memory.start_test()
    gpu_memory.end_test("this test", peaks)
    assert peaks == [] and not torch.cuda.is_initialized()
