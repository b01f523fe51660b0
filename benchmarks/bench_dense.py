"""Time, achieved bandwidth and peak extra memory of the reference W4A16 dense layer per LLM shape, against a
plain BF16 ``torch.matmul`` of the same shape. Prints a table.

    python benchmarks/bench_dense.py                 # LLM shapes, M = 1 and 4096, on CUDA
    python benchmarks/bench_dense.py --tiny          # small shapes (runs on CPU: a smoke test)

Bandwidth counts the bytes a kernel must move at least once: the packed weight and its scales (W4A16) or the
bf16 weight (matmul), plus activations and output. Peak extra memory is ``torch.cuda.max_memory_allocated``
during one call minus what was allocated before it (inputs and prepared weights excluded); the reference
dequantizes a bounded chunk of W at a time, so this stays far below one dequantized fp32 layer (``N*K*4``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance.adapter import DenseLayer  # noqa: E402
from conformance.backends.reference import ReferenceBackend  # noqa: E402
from conformance.dense_cases import LLM_SHAPES  # noqa: E402

TINY_SHAPES = ((256, 256), (512, 256), (320, 1024))


def random_layer(n: int, k: int, device: torch.device, g: torch.Generator) -> DenseLayer:
    """Random checkpoint bytes (any bytes but E4M3 NaN are a valid NVFP4 weight): fast at LLM sizes."""
    packed = torch.randint(0, 256, (n, k // 2), generator=g, device=device, dtype=torch.uint8)
    scales = torch.randint(0x20, 0x60, (n, k // 16), generator=g, device=device, dtype=torch.uint8)
    return DenseLayer(packed, scales.view(torch.float8_e4m3fn), torch.tensor([1e-3], device=device), (n,))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds, after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_extra_bytes(fn, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return peak


def bench_shape(n: int, k: int, m: int, device: torch.device, repeats: int) -> dict:
    g = torch.Generator(device=device).manual_seed(n * 131 + k * 7 + m)
    backend = ReferenceBackend()
    prepared = backend.prepare_dense(random_layer(n, k, device, g), device)
    x = torch.randn(m, k, generator=g, device=device).bfloat16()
    w_bf16 = torch.randn(n, k, generator=g, device=device).bfloat16()

    def ref():
        return backend.run_dense(prepared, x)

    def mm():
        return torch.matmul(x, w_bf16.T)

    t_ref, t_mm = time_call(ref, device, repeats), time_call(mm, device, repeats)
    io = m * k * 2 + m * n * 2
    bytes_ref, bytes_mm = n * k // 2 + n * k // 16 + io, n * k * 2 + io
    peak_ref, peak_mm = peak_extra_bytes(ref, device), peak_extra_bytes(mm, device)
    return dict(n=n, k=k, m=m, t_ref=t_ref, t_mm=t_mm, bw_ref=bytes_ref / t_ref, bw_mm=bytes_mm / t_mm,
                tflops_ref=2 * m * n * k / t_ref / 1e12, peak_ref=peak_ref, peak_mm=peak_mm,
                layer_fp32=n * k * 4)


def _mib(v: int | None) -> str:
    return "n/a" if v is None else f"{v / 2**20:.0f}"


def print_table(rows: list[dict], device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"reference W4A16 dense vs BF16 torch.matmul on {name} (torch {torch.__version__})")
    header = ("N x K", "M", "ref ms", "ref GB/s", "ref TFLOP/s", "bf16 ms", "bf16 GB/s", "ref/bf16",
              "ref peak MiB", "bf16 peak MiB", "fp32 layer MiB")
    print(" | ".join(f"{h:>13}" for h in header))
    for r in rows:
        cells = (f"{r['n']}x{r['k']}", r["m"], f"{r['t_ref'] * 1e3:.3f}", f"{r['bw_ref'] / 1e9:.2f}",
                 f"{r['tflops_ref']:.3f}", f"{r['t_mm'] * 1e3:.3f}", f"{r['bw_mm'] / 1e9:.2f}",
                 f"{r['t_ref'] / r['t_mm']:.1f}x", _mib(r["peak_ref"]), _mib(r["peak_mm"]), _mib(r["layer_fp32"]))
        print(" | ".join(f"{c:>13}" for c in cells))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small shapes (default on CPU)")
    parser.add_argument("--m", type=int, nargs="+", default=None, help="token counts (default: 1 4096; tiny: 1 64)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tiny = args.tiny or device.type == "cpu"
    shapes = TINY_SHAPES if tiny else LLM_SHAPES
    ms = args.m or ([1, 64] if tiny else [1, 4096])
    rows = [bench_shape(n, k, m, device, args.repeats) for n, k in shapes for m in ms]
    print_table(rows, device)
    return rows


if __name__ == "__main__":
    main()
