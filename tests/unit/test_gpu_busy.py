"""The trainer's GPU-busy share (`train.gpu_busy`): NVML's utilization sampled beside the steps."""

from __future__ import annotations

import time

import torch

from hpctoolkit.train.gpu_busy import GpuBusy


def test_a_cpu_trainer_reports_nothing():
    with GpuBusy(torch.device("cpu"), interval_s=0.01) as busy:
        time.sleep(0.05)
    assert busy.fields() == {}


def test_the_share_is_the_mean_of_nvmls_samples(monkeypatch):
    values = iter([100, 100, 50, 0] + [50] * 1000)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: next(values))
    with GpuBusy(torch.device("cuda", 0), interval_s=0.01) as busy:
        while len(busy.samples) < 8:
            time.sleep(0.01)
    got = busy.fields()["gpu_busy"]
    assert got["samples"] == len(busy.samples) >= 8
    assert got["share"] == round(sum(busy.samples) / len(busy.samples) / 100, 3)


def test_without_nvml_there_is_no_figure_and_no_failure(monkeypatch):
    def no_nvml(device=None):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    with GpuBusy(torch.device("cuda", 0), interval_s=0.01) as busy:
        time.sleep(0.03)
    assert busy.fields() == {}
