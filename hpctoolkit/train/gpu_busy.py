"""The trainer's GPU-busy share: NVML's utilization sampled on a thread while the steps run.

NVML's `utilization.gpu` is the share of its last sample period (1/6 s to 1 s, by product) in
which at least one kernel ran on the GPU: what "the GPU is busy" means for a trainer waiting on
its input. `GpuBusy` samples it every `interval_s` while the training loop runs and reports the
mean (`share`, 0..1) and the samples' count in `summary.json` (`gpu_busy`), so a starved input
path shows without a profiler. On a CPU trainer, or without NVML (`nvidia-ml-py`), it reports
nothing. Several processes sharing one GPU (the GPU default's engine beside its trainer) all count:
the share is the GPU's, not only this trainer's.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch


class GpuBusy:
    """A context manager around the training steps; `fields()` is what the summary records."""

    def __init__(self, device: torch.device, interval_s: float = 0.5) -> None:
        self.device = device
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuBusy:
        if self.device.type != "cuda":
            return self
        try:
            torch.cuda.utilization(self.device)  # NVML, mapped through CUDA_VISIBLE_DEVICES
        except Exception:  # noqa: BLE001  -- a figure for the summary, never a reason to fail
            return self
        self._thread = threading.Thread(target=self._run, name="gpu-busy", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):
                self.samples.append(int(torch.cuda.utilization(self.device)))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def fields(self) -> dict[str, Any]:
        if not self.samples:
            return {}
        share = round(sum(self.samples) / len(self.samples) / 100, 3)
        return {"gpu_busy": {"share": share, "samples": len(self.samples), "interval_s": self.interval_s}}
