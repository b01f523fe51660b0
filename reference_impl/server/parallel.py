"""Tensor / data / expert parallelism for the reference server over torch.distributed.

Topology (SGLang's meaning of the flags, with data-parallel attention): ``--tp N`` ranks in all (one process
each; gloo on CPU, NCCL on GPU). ``--dp D`` (D divides N) splits the ranks into D groups of N/D; each request is
served by one group (request i by group i % D) and attention / dense MLPs are tensor-parallel inside the
group. MoE layers span all N ranks: ``--ep E`` (E divides N) splits the experts into E contiguous ranges and
each expert's intermediate dimension over N/E ranks; with D > 1 the groups' tokens are all-gathered before
the experts and each group keeps its own rows after the reduction.

Rank 0 runs the HTTP server and a scheduler thread; it broadcasts each command (generate batch, reload,
release, resume) over a gloo control group and every rank executes it in lock-step.
"""
from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference_impl.model import Comm, Layout
from reference_impl.server.engine import Engine, EngineError


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("tp", "dp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.tp % self.dp or self.tp % self.ep:
            raise ValueError(f"--dp {self.dp} and --ep {self.ep} must divide --tp {self.tp} (the number of ranks)")

    @property
    def world(self) -> int:
        return self.tp

    @property
    def attn_size(self) -> int:
        return self.tp // self.dp

    def dp_rank(self, rank: int) -> int:
        return rank // self.attn_size

    def layout(self, rank: int) -> Layout:
        moe_tp = self.tp // self.ep
        return Layout(attn_rank=rank % self.attn_size, attn_size=self.attn_size,
                      ep_rank=rank // moe_tp, ep_size=self.ep, moe_tp_rank=rank % moe_tp, moe_tp_size=moe_tp)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DistComm(Comm):
    def __init__(self, topo: Topology, rank: int, attn_group, device: str):
        self.topo, self.rank, self.attn_group, self.device = topo, rank, attn_group, device

    def attn_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.topo.attn_size > 1:
            dist.all_reduce(x, group=self.attn_group)
        return x

    def moe_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.topo.world > 1:
            dist.all_reduce(x)
        return x

    def moe_gather(self, x: torch.Tensor) -> tuple[torch.Tensor, slice]:
        if self.topo.dp == 1:
            return x, slice(0, x.shape[0])
        world, dtype = self.topo.world, x.dtype
        n = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        sizes = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(sizes, n)
        sizes = [int(s) for s in sizes]
        padded = torch.zeros(max(sizes), x.shape[1], dtype=torch.float64, device=x.device)
        padded[: x.shape[0]] = x.double()  # exact: bf16 -> fp64 -> bf16 round-trips
        parts = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        leaders = [g * self.topo.attn_size for g in range(self.topo.dp)]  # one rank per group (replicas agree)
        xs = torch.cat([parts[r][: sizes[r]] for r in leaders]).to(dtype)
        me = self.topo.dp_rank(self.rank)
        start = sum(sizes[leaders[g]] for g in range(me))
        return xs, slice(start, start + x.shape[0])


@dataclass(frozen=True)
class LaunchConfig:
    model_path: str
    topo: Topology
    device: str  # "cpu" or "cuda"
    init_method: str = ""


def _device_for(rank: int, kind: str) -> str:
    return f"cuda:{rank}" if kind == "cuda" else "cpu"


class RankRuntime:
    """What every rank holds: the engine and the process groups."""

    def __init__(self, rank: int, cfg: LaunchConfig):
        torch.set_num_threads(1)  # tiny tensors: threads only add contention
        self.rank, self.cfg, topo = rank, cfg, cfg.topo
        device = _device_for(rank, cfg.device)
        self.ctrl = None
        attn_group = None
        if topo.world > 1:
            if cfg.device == "cuda":
                torch.cuda.set_device(rank)
            backend = "nccl" if cfg.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=cfg.init_method, rank=rank, world_size=topo.world)
            self.ctrl = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
            for g in range(topo.dp):
                group = dist.new_group(list(range(g * topo.attn_size, (g + 1) * topo.attn_size)))
                if topo.dp_rank(rank) == g:
                    attn_group = group
        comm = DistComm(topo, rank, attn_group, device) if topo.world > 1 else Comm()
        self.engine = Engine(cfg.model_path, topo.layout(rank), comm, device, topo.dp_rank(rank), topo.dp,
                             world_agree=self.agree if topo.world > 1 else None)

    def agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.ctrl)
        return bool(flag.item())

    def execute(self, cmd: tuple):
        """Run one command on this rank; generate results are gathered to rank 0."""
        kind, arg = cmd
        e = self.engine
        try:
            if kind == "generate":
                out = e.generate(arg)
            elif kind == "update":
                out = e.update_weights_from_disk(arg)
            elif kind == "release":
                out = e.release_memory_occupation(arg)
            elif kind == "offload":  # release keeping a CPU copy of the weights (vLLM's sleep level 1)
                out = e.release_memory_occupation(arg, offload_weights=True)
            elif kind == "resume":
                out = e.resume_memory_occupation(arg)
            elif kind == "flush":
                out = None
            else:
                raise EngineError(f"unknown command {kind!r}")
        except EngineError as exc:
            out = exc
        if kind == "generate" and self.cfg.topo.world > 1:
            gathered = [None] * self.cfg.topo.world if self.rank == 0 else None
            dist.gather_object(out, gathered, dst=0, group=self.ctrl)
            if self.rank == 0:
                errors = [g for g in gathered if isinstance(g, Exception)]
                if errors:
                    return errors[0]
                merged = {}
                for g in gathered:
                    merged.update(g)
                return merged
        return out

    def broadcast(self, cmd: tuple | None) -> tuple:
        if self.cfg.topo.world == 1:
            return cmd
        box = [cmd]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]


def worker_main(rank: int, cfg: LaunchConfig) -> None:
    """Ranks 1..N-1: execute broadcast commands until shutdown (or until the parent process dies)."""
    parent = os.getppid()

    def watchdog():
        import time

        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watchdog, daemon=True).start()
    rt = RankRuntime(rank, cfg)
    while True:
        cmd = rt.broadcast(None)
        if cmd[0] == "shutdown":
            break
        rt.execute(cmd)
    dist.destroy_process_group()
