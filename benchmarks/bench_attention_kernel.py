"""The probed attention of one layer of an fp32 probed pass (a long prefill's ``T^2`` work), measured in the same
run: the eager path (``reference_impl.truth.instrument.truth_attention`` with the kernels off: blocks of queries,
``[S, K, H, Tq, Tk]`` tensors) against the Triton kernels (reference_impl/truth/attention_kernel.py) in each
configuration asked for (``BLOCK_M,BLOCK_N,WARPS,STAGES,PRECISION``; the default's first), and each kernel's
arithmetic without draws against the first configuration's (the largest relative difference of the output and
the tangent). Random operands at a model's head shape (one sequence, ``--replicas`` probes).

    python benchmarks/bench_attention_kernel.py --device cuda --lengths 2049,8257 \\
        --configs "64,32,8,1,ieee;64,32,8,1,tf32x3;64,64,4,1,tf32x3"

The last column, ``x layers``, is a call's time times ``--layers`` (the 8B shape's 32): what a sequence of that
length spends there per probed pass."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.autograd.forward_ad as fwAD  # noqa: E402

from benchmarks.timing import wall_times  # noqa: E402


def _eager(q1, k1, v1, qt, kt, vt, scale: float, reps: int):
    """The eager path's probed attention (the kernels off), as an fp32 probed pass calls it."""
    from reference_impl.truth import instrument
    from reference_impl.truth.probe_draws import Probe

    gen = torch.Generator(device=q1.device).manual_seed(1)
    probe = Probe(reps, q1.shape[2], generator=gen, sequences=q1.shape[0])
    with mock.patch.dict(os.environ, {"TRUTH_ATTENTION_KERNEL": "0"}), fwAD.dual_level(), \
            instrument.recording(instrument.Recorder(None, False, probe=probe)):
        duals = [probe.join(a, b) for a, b in ((q1, qt), (k1, kt), (v1, vt))]
        out, _ = instrument.truth_attention(None, *duals, None, scale)
        return fwAD.unpack_dual(out).tangent


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="2049,8257", help="sequence lengths, comma-separated")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--configs", default="", help="';'-separated BLOCK_M,BLOCK_N,WARPS,STAGES,PRECISION")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager path (its T^2 tensors are large)")
    args = ap.parse_args(argv)
    from reference_impl.truth import attention_kernel as ak
    from reference_impl.truth.stores import U_ACCUM, U_BF16

    configs = [ak.KernelConfig.from_environment()] + [ak.KernelConfig.parse(c) for c in args.configs.split(";")
                                                      if c.strip()]
    print(f"| length | path | config | first s | s per call | x {args.layers} layers s | eager / this "
          "| max rel. diff (no draws) | peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device=args.device).manual_seed(0)
    for t in (int(x) for x in args.lengths.split(",")):
        h, d, k = args.heads, args.dim, args.replicas
        q1, k1, v1 = (torch.randn(1, h, t, d, generator=g, device=args.device) for _ in range(3))
        qt, kt, vt = (1e-3 * torch.randn(k, h, t, d, generator=g, device=args.device) for _ in range(3))
        scale = d ** -0.5
        eager_s = float("nan")
        if not args.no_eager:
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            (first, eager_s), _ = wall_times(args.device, lambda: _eager(q1, k1, v1, qt, kt, vt, scale, k))
            print(f"| {t} | eager | | {first:.3f} | {eager_s:.3f} | {eager_s * args.layers:.1f} | 1.00 | | "
                  f"{_peak(args.device)} |", flush=True)
        reference = None
        for cfg in configs:
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            try:
                (first, per), _ = wall_times(args.device, lambda: ak.probed_attention(
                    q1, k1, v1, qt, kt, vt, scale, U_BF16, U_ACCUM * (d + 2), 7, config=cfg))
                _, ot = ak.probed_attention(q1, k1, v1, qt, kt, vt, scale, 0.0, 0.0, 7, config=cfg)[::2]
            except Exception as exc:  # a configuration the GPU cannot run (shared memory, registers): say so
                print(f"| {t} | kernel | {','.join(map(str, cfg))} | failed: {type(exc).__name__}: "
                      f"{str(exc)[:120]} | | | | | |", flush=True)
                continue
            reference = ot if reference is None else reference
            diff = float((ot - reference).abs().max() / reference.abs().max())
            print(f"| {t} | kernel | {','.join(map(str, cfg))} | {first:.3f} | {per:.4f} | {per * args.layers:.2f} "
                  f"| {eager_s / per:.1f} | {diff:.1e} | {_peak(args.device)} |", flush=True)


def _peak(device: str) -> str:
    return f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f}" if device.startswith("cuda") else ""


if __name__ == "__main__":
    main()
