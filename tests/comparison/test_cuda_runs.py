"""The settings of the processes that run the comparison's runs on CUDA (issue 25: several runs per GPU with the records
of the runs made one by one), checked without a GPU: the device is only named, never used."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from gpattn.comparison.runner import run_environment


def test_cuda_runs_use_deterministic_kernels_and_their_device(monkeypatch):
    devices = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with run_environment(SimpleNamespace(threads=1, device="cuda:1")):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # before the first cuBLAS call of the process
        assert torch.get_num_threads() == 1
    assert devices == [torch.device("cuda:1")]
    after = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    assert after == before  # the caller's settings are restored


def test_cpu_runs_change_nothing_but_the_threads(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: (_ for _ in ()).throw(AssertionError(device)))
    before = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    with run_environment(SimpleNamespace(threads=1, device="cpu")):
        assert torch.are_deterministic_algorithms_enabled() == before
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads
