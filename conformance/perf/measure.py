"""The perf tier's measurements: is a W4A16 backend worth it next to BF16, and how close is it to the floor?

For each shape the backend's time is set against two yardsticks measured in the same process:

* a **BF16 baseline** of the same shape: ``torch.matmul(x, W^T)`` (dense), or a BF16 MoE built from
  ``torch._grouped_mm`` on the same routing (gather, grouped GEMM1, SwiGLU, grouped GEMM2, weighted combine;
  a per-expert ``torch.mm`` loop where the build lacks ``_grouped_mm``);
* the **W4A16 floor**: ``max(bytes / copy bandwidth, FLOPs / BF16 matmul rate)``, where ``bytes`` is what a
  W4A16 kernel must move at least once (packed weights and block scales of the experts it uses, activations
  in, output out), the copy bandwidth is a measured device-to-device copy (read + write) and the rate a
  measured large BF16 matmul.

Timing (:meth:`Timer.medians`): on CUDA, CUDA events around each call, ``WARMUP`` calls first, the median of
``REPEATS`` calls, the backend's and the baseline's calls interleaved (drift reaches both alike), and the L2 cache flushed before every timed call (a 256 MiB memset, outside the events):
at decode sizes a layer's packed weights (9 MiB for 4096x4096) would otherwise sit in the 50-60 MiB L2 of
an H100/H200 and the backend would be timed on cache bandwidth. The flush is queued ahead of the call, so
host-side launch latency overlaps it and the events see device time (a call that synchronizes the host
inside still pays for that). On CPU, ``time.perf_counter`` around each call (no flush).
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from conformance.interfaces.kernel import Backend, CaseInfo, DenseLayer, MoEExperts
from conformance._framework.dense_layers import LLM_SHAPES

WARMUP = 3
REPEATS = 10
L2_FLUSH_BYTES = 256 << 20
PERF_TOKENS = (1, 16, 256, 4096)
#: (name, experts, hidden, intermediate, top_k): Mixtral-8x7B-like and DeepSeek-V3-like routed experts.
MOE_SHAPES = (("mixtral-like", 8, 4096, 14336, 2), ("deepseek-like", 256, 7168, 2048, 8))
#: Small shapes for a CPU run (it checks the machinery, not a GPU's speed).
CPU_DENSE_SHAPES = ((512, 256),)
CPU_MOE_SHAPES = (("tiny-moe", 8, 256, 128, 2),)
CPU_TOKENS = (1, 16)


# ----------------------------------------------------------------------------------------- timing
class Timer:
    """Median time of a call on one device (module docstring)."""

    def __init__(self, device: torch.device, warmup: int = WARMUP, repeats: int = REPEATS) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def median(self, fn: Callable[[], Any]) -> float:
        return self.medians(fn)[0]

    def medians(self, *fns: Callable[[], Any]) -> tuple[float, ...]:
        """The median time of each of ``fns``, measured interleaved (every repeat times each once, in turn),
        so that drift over the run (clocks, a neighbour's load, allocator state) reaches all of them alike
        and their ratio stays meaningful."""
        for _ in range(self.warmup):
            for fn in fns:
                fn()
        if self.device.type != "cuda":
            times: list[list[float]] = [[] for _ in fns]
            for _ in range(self.repeats):
                for fn, out in zip(fns, times):
                    start = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - start)
            return tuple(statistics.median(t) for t in times)
        events: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [[] for _ in fns]
        for _ in range(self.repeats):
            for fn, out in zip(fns, events):
                self._flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                out.append((start, end))
        torch.cuda.synchronize(self.device)
        return tuple(statistics.median(s.elapsed_time(e) for s, e in ev) / 1e3 for ev in events)


@dataclass(frozen=True)
class DeviceRates:
    """Measured yardsticks of the floor: device copy bandwidth (bytes/s, read + write counted) and a large
    BF16 matmul's rate (FLOP/s)."""

    device: str
    copy_bytes_per_s: float
    bf16_flops_per_s: float

    def floor_time(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.copy_bytes_per_s, flops / self.bf16_flops_per_s)


def measure_device_rates(device: torch.device) -> DeviceRates:
    cuda = device.type == "cuda"
    timer = Timer(device)
    n_copy = (1 << 30) if cuda else (64 << 20)
    src = torch.empty(n_copy, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t_copy = timer.median(lambda: dst.copy_(src))
    del src, dst
    n = 8192 if cuda else 1024
    a = torch.randn(n, n, device=device).bfloat16()
    b = torch.randn(n, n, device=device).bfloat16()
    t_mm = timer.median(lambda: a @ b)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    return DeviceRates(name, 2 * n_copy / t_copy, 2 * n**3 / t_mm)


# ----------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class PerfRow:
    """One measured shape. Times in seconds; ``bytes``/``flops`` are the W4A16 minimum (module docstring)."""

    kind: str  # "dense" or "moe"
    backend: str
    shape: str  # "NxK" or "<name> E=<experts> HxI top<k>"
    tokens: int
    time_s: float
    baseline_s: float
    floor_s: float
    nbytes: float
    flops: float
    baseline: str

    @property
    def gbps(self) -> float:
        return self.nbytes / self.time_s / 1e9

    @property
    def tflops(self) -> float:
        return self.flops / self.time_s / 1e12

    @property
    def vs_bf16(self) -> float:
        return self.time_s / self.baseline_s

    @property
    def vs_floor(self) -> float:
        return self.time_s / self.floor_s

    def flags(self, small_tokens: int = 16) -> list[str]:
        """Findings worth a reader's attention (never failures by themselves)."""
        out = []
        if self.tokens <= small_tokens and self.vs_bf16 > 1.0:
            out.append(f"slower than BF16 at {self.tokens} token(s) ({self.vs_bf16:.2f}x): W4A16 moves ~3.5x fewer "
                       f"weight bytes, so a memory-bound W4A16 kernel should beat BF16 here")
        return out

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(gbps=self.gbps, tflops=self.tflops, vs_bf16=self.vs_bf16, vs_floor=self.vs_floor, flags=self.flags())
        return d


# ----------------------------------------------------------------------------------------- dense
def random_dense_layer(n: int, k: int, device: torch.device, seed: int = 0) -> DenseLayer:
    """Random checkpoint bytes (any byte is a valid pair of E2M1 codes; scales kept normal, no NaN)."""
    g = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, device=device, dtype=torch.uint8)
    scales = torch.randint(0x20, 0x60, (n, k // 16), generator=g, device=device, dtype=torch.uint8)
    return DenseLayer(packed, scales.view(torch.float8_e4m3fn), torch.tensor([1e-3], device=device), (n,))


def dense_bytes_and_flops(m: int, n: int, k: int) -> tuple[float, float]:
    return n * k / 2 + n * k / 16 + 4 + m * k * 2 + m * n * 2, 2.0 * m * n * k


def measure_dense(backend: Backend, n: int, k: int, m: int, rates: DeviceRates, timer: Timer) -> PerfRow:
    device = timer.device
    g = torch.Generator(device=device).manual_seed(n * 131 + k * 7 + m)
    prepared = backend.prepare_dense(random_dense_layer(n, k, device), device)
    x = torch.randn(m, k, generator=g, device=device).bfloat16()
    w_bf16 = torch.randn(n, k, generator=g, device=device).bfloat16()
    t, t_mm = timer.medians(lambda: backend.run_dense(prepared, x), lambda: torch.matmul(x, w_bf16.T))
    nbytes, flops = dense_bytes_and_flops(m, n, k)
    return PerfRow("dense", backend.name, f"{n}x{k}", m, t, t_mm, rates.floor_time(nbytes, flops), nbytes, flops,
                   "torch.matmul bf16")


def dense_case_info(n: int, k: int, m: int, device: torch.device) -> CaseInfo:
    return CaseInfo("dense", device, {"m": m, "n": n, "k": k}, frozenset({"perf"}))


# ----------------------------------------------------------------------------------------- MoE
def random_experts(num_experts: int, hidden: int, inter: int, device: torch.device, seed: int = 0) -> MoEExperts:
    g = torch.Generator(device=device).manual_seed(seed)

    def packed(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randint(0, 256, (num_experts, rows, cols // 2), generator=g, device=device, dtype=torch.uint8)
        s = torch.randint(0x20, 0x60, (num_experts, rows, cols // 16), generator=g, device=device, dtype=torch.uint8)
        return q, s.view(torch.float8_e4m3fn)

    w13, s13 = packed(2 * inter, hidden)
    w2, s2 = packed(hidden, inter)
    return MoEExperts(w13, s13, torch.full((num_experts, 2), 1e-3, device=device), w2, s2,
                      torch.full((num_experts,), 1e-3, device=device), num_global_experts=num_experts)


def random_routing(tokens: int, num_experts: int, top_k: int, device: torch.device, seed: int = 1):
    """Softmax top-k of random logits (renormalized): the usual balanced-on-average routing."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g, device=device)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return ids.to(torch.int32), (weights / weights.sum(-1, keepdim=True)).float()


def has_grouped_mm(device: torch.device) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        torch._grouped_mm(a, torch.ones(2, 16, 16, dtype=torch.bfloat16, device=device).transpose(1, 2),
                          offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, TypeError, NotImplementedError):
        return False


class BF16MoE:
    """The BF16 baseline MoE (module docstring) on bf16 weights ``w13 [E, 2I, H]`` (halves), ``w2 [E, H, I]``."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13, self.w2 = w13, w2
        self.grouped = has_grouped_mm(w13.device)
        self.name = "torch._grouped_mm bf16 MoE" if self.grouped else "per-expert torch.mm bf16 MoE"

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = ids.shape
        num_experts, inter = self.w13.shape[0], self.w2.shape[2]
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        xs = x[order // top_k]
        counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        if self.grouped:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offs)
            a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            o = torch._grouped_mm(a, self.w2.transpose(1, 2), offs=offs)
        else:
            o = torch.empty(xs.shape[0], self.w2.shape[1], dtype=torch.bfloat16, device=x.device)
            start = 0
            for e, c in enumerate(counts.tolist()):
                if c:
                    h = xs[start:start + c] @ self.w13[e].T
                    o[start:start + c] = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ self.w2[e].T
                    start += c
        out = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.bfloat16, device=x.device)
        out[order] = o * weights.reshape(-1)[order].unsqueeze(-1).to(o.dtype)
        return out.view(tokens, top_k, -1).sum(dim=1)


def moe_bytes_and_flops(tokens: int, top_k: int, hidden: int, inter: int, experts_used: int) -> tuple[float, float]:
    per_expert = 3 * hidden * inter * (0.5 + 1 / 16) + 3 * 4  # packed codes + block scales + decode scales
    io = tokens * hidden * 2 * 2 + tokens * top_k * (4 + 4)  # x in, y out, ids and weights
    return experts_used * per_expert + io, 2.0 * tokens * top_k * 3 * hidden * inter


def measure_moe(backend: Backend, name: str, num_experts: int, hidden: int, inter: int, top_k: int, tokens: int,
                rates: DeviceRates, timer: Timer, prepared_cache: dict | None = None) -> PerfRow:
    """``prepared_cache`` (a dict the caller keeps) reuses the prepared layer and baseline weights across
    token counts of one shape; it holds one shape at a time."""
    device = timer.device
    key = (backend.name, name)
    cache = prepared_cache if prepared_cache is not None else {}
    if key not in cache:
        cache.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        experts = random_experts(num_experts, hidden, inter, device)
        g = torch.Generator(device=device).manual_seed(3)
        baseline = BF16MoE(torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device, dtype=torch.bfloat16),
                           torch.randn(num_experts, hidden, inter, generator=g, device=device, dtype=torch.bfloat16))
        cache[key] = (experts, backend.prepare_moe(experts, device), baseline)
    experts, prepared, baseline = cache[key]
    ids, weights = random_routing(tokens, num_experts, top_k, device)
    x = torch.randn(tokens, hidden, generator=torch.Generator(device=device).manual_seed(2), device=device).bfloat16()
    t, t_base = timer.medians(lambda: backend.run_moe(prepared, x, ids, weights), lambda: baseline(x, ids, weights))
    used = int(torch.unique(ids).numel())
    nbytes, flops = moe_bytes_and_flops(tokens, top_k, hidden, inter, used)
    shape = f"{name} E={num_experts} {hidden}x{inter} top{top_k}"
    return PerfRow("moe", backend.name, shape, tokens, t, t_base, rates.floor_time(nbytes, flops), nbytes, flops,
                   baseline.name)


def moe_case_info(num_experts: int, hidden: int, inter: int, top_k: int, tokens: int, device: torch.device) -> CaseInfo:
    shape = dict(tokens=tokens, experts=num_experts, top_k=top_k, hidden=hidden, intermediate=inter, ep_size=1)
    return CaseInfo("moe", device, shape, frozenset({"perf", "swiglu"}))


# ----------------------------------------------------------------------------------------- shapes and table
def dense_shapes(device_type: str) -> list[tuple[int, int, int]]:
    """``(N, K, M)`` of the perf tier on this kind of device."""
    if device_type == "cuda":
        return [(n, k, m) for n, k in LLM_SHAPES for m in PERF_TOKENS]
    return [(n, k, m) for n, k in CPU_DENSE_SHAPES for m in CPU_TOKENS]


def moe_shapes(device_type: str) -> list[tuple[str, int, int, int, int, int]]:
    """``(name, E, H, I, top_k, T)`` of the perf tier on this kind of device."""
    if device_type == "cuda":
        return [(*s, t) for s in MOE_SHAPES for t in PERF_TOKENS]
    return [(*s, t) for s in CPU_MOE_SHAPES for t in CPU_TOKENS]


TABLE_HEADER = ("kind", "backend", "shape", "tokens", "time ms", "GB/s", "TFLOP/s", "baseline ms", "vs BF16",
                "vs floor", "flags")


def table_cells(row: dict[str, Any]) -> tuple[str, ...]:
    """One row of the perf table from a :meth:`PerfRow.as_dict` (as recorded in a report)."""
    return (row["kind"], row["backend"], row["shape"], str(row["tokens"]), f"{row['time_s'] * 1e3:.4g}",
            f"{row['gbps']:.4g}", f"{row['tflops']:.4g}", f"{row['baseline_s'] * 1e3:.4g}", f"{row['vs_bf16']:.2f}x",
            f"{row['vs_floor']:.2f}x", "; ".join(row.get("flags", [])))


def format_rate(rates: DeviceRates) -> str:
    return (f"{rates.device}: copy {rates.copy_bytes_per_s / 1e9:.4g} GB/s, "
            f"BF16 matmul {rates.bf16_flops_per_s / 1e12:.3g} TFLOP/s")


def is_finite_row(row: dict[str, Any]) -> bool:
    return all(math.isfinite(float(row[k])) for k in ("time_s", "baseline_s", "floor_s"))
