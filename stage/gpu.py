"""The GPU side of a stage's workers: which CUDA device each uses, how their work is timed, and
GPU utilization through NVML (nvidia-ml-py's ``pynvml``). Utilization is reported beside the
workers' busy time (DESIGN §9) and shown by `onepiece status`; the NM's elastic policy judges
busy time, which also counts the host-side work of a request. No driver or no CUDA device
means no figure, never an error.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

log = logging.getLogger(__name__)


def worker_device(device: str, index: int, workers: int) -> str:
    """The torch device of a stage's worker ``index`` of ``workers``: on CUDA, one device per
    worker when there are several (``cuda:index``), else the stage's own."""
    return f"cuda:{index}" if device.startswith("cuda") and workers > 1 else device


def cuda_indices(device: str, workers: int) -> list[int]:
    """The CUDA device indices a stage's workers use, as the process sees them."""
    if not device.startswith("cuda"):
        return []
    devices = dict.fromkeys(worker_device(device, i, workers) for i in range(workers))  # in order, once each
    return [int(i) if (i := d.partition(":")[2]).isdigit() else 0 for d in devices]


def lacking(device: str, workers: int = 1) -> str | None:
    """Why this host cannot run ``workers`` workers on ``device`` (None: it can). Started anyway,
    such a worker fails at every start, and its stage is never ready while saying so only in its
    log."""
    indices = cuda_indices(device, workers)
    if not indices:
        return None
    import torch

    if not torch.cuda.is_available():
        return "this host has no CUDA device" if torch.version.cuda else f"this torch ({torch.__version__}) has no CUDA"
    n = torch.cuda.device_count()
    return f"it needs cuda:{max(indices)} and this host has {n} CUDA device(s)" if max(indices) >= n else None


def synchronizer(device: Any) -> Callable[[], None]:
    """What waits until ``device`` has run the work queued on it. A CUDA call returns once its
    kernels are queued, so a step's or a call's time is read after this (else the cost model
    learns launch times); a no-op on the CPU."""
    if not str(device).startswith("cuda"):
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device)


class GpuUtilization:
    """NVML's view of a stage's GPUs: their utilization, and their UUIDs (``uuids``), by which
    the NM finds the stages that share a card (nm/capacity.py)."""

    def __init__(self, indices: list[int]) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self.uuids: list[str] = []
        if not indices:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [self._handle(pynvml, i) for i in indices]
            self._nvml = pynvml
            self.uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in self._handles]
        except Exception as e:  # no driver, no library, a bad index: the figures are just absent
            log.info("no GPU utilization from NVML: %s", e)

    @staticmethod
    def _handle(pynvml: Any, index: int) -> Any:
        # NVML numbers every GPU of the machine; CUDA numbers the visible ones.
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if index < len(visible):
            v = visible[index]
            return (pynvml.nvmlDeviceGetHandleByIndex(int(v)) if v.isdigit()
                    else pynvml.nvmlDeviceGetHandleByUUID(v))
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def sample(self) -> float | None:
        """Mean utilization of the devices over NVML's last sample period, in [0, 1]."""
        if self._nvml is None:
            return None
        try:
            rates = [self._nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self._handles]
        except Exception as e:
            log.warning("NVML utilization failed: %s", e)
            return None
        return sum(rates) / (100.0 * len(rates))


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v  # older NVML bindings answer bytes
