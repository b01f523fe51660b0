"""The reference W4A16 dense layer against a plain BF16 ``torch.matmul`` of the same shape, per LLM shape and
token count, measured in one run (CUDA events, warm-up, median of repeats, L2 flushed before each timed
call: :mod:`conformance.perf.measure`). Prints a table.

    python benchmarks/bench_dense.py                 # LLM shapes, M = 1 16 256 4096, on CUDA
    python benchmarks/bench_dense.py --tiny          # small shapes (runs on CPU: a smoke test)

Columns: reference time, achieved GB/s (the bytes a W4A16 kernel must move: packed weight, block scales,
activations, output) and TFLOP/s; the BF16 matmul's time and the ratio; the ratio to the W4A16 floor
(``max(bytes / copy bandwidth, FLOPs / BF16 matmul rate)``, both measured here); the fp64 exact evaluation
the error bounds use (``w4a16_linear_exact``, once per case in the suite); the one-time decode
(``prepare``: NVFP4 -> exact bf16) and its GB/s (packed bytes read + bf16 written); peak extra memory of a
call and of the prepare step (CUDA only), next to the layer's bf16 size.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import synchronize as _sync  # noqa: E402
from conformance.perf import measure as perf  # noqa: E402
from conformance.adapters.reference.kernel import ReferenceBackend  # noqa: E402
from reference_impl.dense import w4a16_linear_exact  # noqa: E402

TINY_SHAPES = ((256, 256), (512, 256), (320, 1024))


def peak_extra_bytes(fn, device: torch.device) -> int | None:
    """``max_memory_allocated`` during ``fn()`` minus what was allocated before (result kept alive)."""
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


def wall(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def bench_shape(n: int, k: int, m: int, rates: perf.DeviceRates, timer: perf.Timer, exact: bool) -> dict:
    device = timer.device
    backend = ReferenceBackend()
    row = perf.measure_dense(backend, n, k, m, rates, timer)
    layer = perf.random_dense_layer(n, k, device)
    t_prepare = min(wall(lambda: backend.prepare_dense(layer, device), device) for _ in range(2))
    peak_prepare = peak_extra_bytes(lambda: backend.prepare_dense(layer, device), device)
    prepared = backend.prepare_dense(layer, device)
    x = torch.randn(m, k, device=device).bfloat16()
    peak_run = peak_extra_bytes(lambda: backend.run_dense(prepared, x), device)
    t_exact = wall(lambda: w4a16_linear_exact(x, layer.weight, layer.weight_scale, layer.weight_scale_2), device) if exact else None
    return dict(row=row, t_prepare=t_prepare, decode_gbps=(n * k * (0.5 + 1 / 16) + n * k * 2) / t_prepare / 1e9,
                t_exact=t_exact, peak_run=peak_run, peak_prepare=peak_prepare, layer_bf16=n * k * 2)


def _mib(v: int | None) -> str:
    return "n/a" if v is None else f"{v / 2**20:.0f}"


def print_table(results: list[dict], rates: perf.DeviceRates) -> None:
    print(f"reference W4A16 dense vs BF16 torch.matmul, torch {torch.__version__}; {perf.format_rate(rates)}")
    header = ("N x K", "M", "ref ms", "GB/s", "TFLOP/s", "bf16 ms", "ref/bf16", "ref/floor", "fp64 exact ms",
              "prepare ms", "decode GB/s", "run peak MiB", "prep peak MiB", "bf16 layer MiB")
    print(" | ".join(f"{h:>13}" for h in header))
    for r in results:
        row = r["row"]
        cells = (row.shape, row.tokens, f"{row.time_s * 1e3:.4f}", f"{row.gbps:.0f}", f"{row.tflops:.2f}",
                 f"{row.baseline_s * 1e3:.4f}", f"{row.vs_bf16:.2f}x", f"{row.vs_floor:.2f}x",
                 "-" if r["t_exact"] is None else f"{r['t_exact'] * 1e3:.1f}", f"{r['t_prepare'] * 1e3:.2f}",
                 f"{r['decode_gbps']:.0f}", _mib(r["peak_run"]), _mib(r["peak_prepare"]), _mib(r["layer_bf16"]))
        print(" | ".join(f"{c:>13}" for c in cells))
    worst = max(results, key=lambda r: r["row"].vs_bf16)["row"]
    print(f"worst ratio to BF16 matmul: {worst.vs_bf16:.3f}x ({worst.shape}, M={worst.tokens})")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small shapes (default on CPU)")
    parser.add_argument("--m", type=int, nargs="+", default=None, help="token counts (default: 1 16 256 4096; tiny: 1 64)")
    parser.add_argument("--repeats", type=int, default=perf.REPEATS)
    parser.add_argument("--no-exact", action="store_true", help="skip timing the fp64 exact evaluation")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tiny = args.tiny or device.type == "cpu"
    shapes = TINY_SHAPES if tiny else perf.LLM_SHAPES
    ms = args.m or ([1, 64] if tiny else list(perf.PERF_TOKENS))
    timer = perf.Timer(device, repeats=args.repeats)
    rates = perf.measure_device_rates(device)
    results = [bench_shape(n, k, m, rates, timer, not args.no_exact) for n, k in shapes for m in ms]
    print_table(results, rates)
    return results


if __name__ == "__main__":
    main()
