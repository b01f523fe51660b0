"""Parallel configurations a server is started in, one hardware tier each.

Generic in the GPU count ``n`` (detected, or ``--server-gpus``): the ``multi_gpu`` tier runs TPn and
TPn/DPn/EPn, so two H200s give TP2 and TP2/DP2/EP2 and eight give TP8 and TP8/DP8/EP8.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    tp: int = 1
    dp: int = 1
    ep: int = 1
    device: str = "cpu"
    tier: str = "cpu"

    @property
    def id(self) -> str:
        parts = [f"tp{self.tp}"] + [f"{k}{v}" for k, v in (("dp", self.dp), ("ep", self.ep)) if v > 1]
        return f"{self.device}-{'-'.join(parts)}"

    @property
    def world(self) -> int:
        return self.tp

    def single_rank(self) -> "ServerConfig":
        """The TP1 configuration on the same kind of device (the baseline of TP agreement)."""
        return ServerConfig(1, 1, 1, self.device, "cpu" if self.device == "cpu" else "cuda")


def reference_configs(gpu_count: int) -> list[ServerConfig]:
    n = max(2, gpu_count)
    return [
        ServerConfig(1, device="cpu", tier="cpu"),
        ServerConfig(2, device="cpu", tier="cpu"),  # gloo
        ServerConfig(2, 2, 2, device="cpu", tier="cpu"),  # data-parallel attention + expert parallel, gloo
        ServerConfig(1, device="cuda", tier="cuda"),  # NCCL world of one
        ServerConfig(n, device="cuda", tier="multi_gpu"),
        ServerConfig(n, n, n, device="cuda", tier="multi_gpu"),
        ServerConfig(4, 4, 4, device="cuda", tier="b200_4gpu"),  # the upstream engine test's layout
    ]


_SPEC = re.compile(r"^(?:(cpu|cuda)-)?tp(\d+)(?:-dp(\d+))?(?:-ep(\d+))?$")


def parse_configs(text: str) -> list[ServerConfig]:
    """``"tp1,cuda-tp2-dp2-ep2"`` -> configs; the device defaults to cuda; the tier follows the GPU count."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = _SPEC.match(item)
        if not m:
            raise ValueError(f"bad server config {item!r}: expected [cpu-|cuda-]tpN[-dpN][-epN]")
        device = m.group(1) or "cuda"
        tp, dp, ep = int(m.group(2)), int(m.group(3) or 1), int(m.group(4) or 1)
        tier = "cpu" if device == "cpu" else ("cuda" if tp == 1 else "multi_gpu")
        out.append(ServerConfig(tp, dp, ep, device, tier))
    return out
