"""Wall-clock helpers the benchmarks share: the device synchronised around each timed call, so a GPU's queued
work is counted where it was launched."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_times(device: str | torch.device, run: Callable[[], T], calls: int = 2) -> tuple[list[float], T]:
    """The wall times of ``calls`` calls of ``run`` (the first one's includes compilation and caches), and the
    last call's result."""
    times: list[float] = []
    out = None
    for _ in range(calls):
        synchronize(device)
        t0 = time.perf_counter()
        out = run()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times, out
