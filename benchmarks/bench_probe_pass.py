"""Time per judged token of the truth's probed passes (reference_impl/truth/probes.py) by precision, measured in
the same run on the same sequences: the fp64 forward of the values alone (``values``), fp64, fp32 with BF16 tangent GEMMs (the default of ``fp32``) and with TF32
ones, and with the dense MLP through forward_ad instead of by hand (``fp32-bf16-fwad-mlp``; the last column's
baseline when fp64 is not run), each with the decoder layers kept between passes (``keeping_layers``; the first pass, which builds them,
timed apart). Optionally the GPU time by kernel of one fp32 pass (``--profile``).

    python benchmarks/bench_probe_pass.py --checkpoint /tmp/m8b --device cuda --shapes 7x79,1x2047

A shape ``NxT``: N sequences of T rows (prompt + continuation - 1), judged in one call (sequences of one length
share passes)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _twice(device: str, run) -> list[float]:
    """The wall times of two calls of ``run`` (the device synchronised around each)."""
    times = []
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _profile(device: str, run) -> None:
    """The time by kernel (CUDA) or operator (CPU) of one call of ``run``."""
    from torch.profiler import ProfilerActivity, profile as prof

    acts = [ProfilerActivity.CUDA] if device.startswith("cuda") else [ProfilerActivity.CPU]
    with prof(activities=acts) as p:
        run()
        _sync(device)
    key = "cuda_time_total" if device.startswith("cuda") else "cpu_time_total"
    print(p.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))


def measure(checkpoint: str, device: str, shapes: list[tuple[int, int]], probes: int, modes: list[str],
            profile: bool = False) -> list[dict]:
    import reference_impl.truth.probe_pass as pass_
    import reference_impl.truth.probes as P
    from reference_impl.truth.golden import ExactModel

    model = ExactModel(checkpoint, device)
    plain_mlp = pass_._plain_mlp
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, t in shapes:
        seqs = [torch.randint(0, model.cfg.vocab_size, (t,), generator=g).tolist() for _ in range(n)]
        targets = [s[1:] + [s[0]] for s in seqs]
        for mode in modes:
            if mode == "values":  # the fp64 forward an fp32 pass takes its values from, alone
                times = _twice(device, lambda: pass_.values_fp64(model.truth, seqs, targets))
            else:
                precision, gemm = {"fp64": ("fp64", None), "fp32-bf16": ("fp32", torch.bfloat16),
                                   "fp32-tf32": ("fp32", None), "fp32-bf16-fwad-mlp": ("fp32", torch.bfloat16)}[mode]
                pass_.TANGENT_GEMM = gemm
                # fwad-mlp: the dense MLP through forward_ad, not by hand (what probe_pass._ProbedMLP saves)
                pass_._plain_mlp = (lambda cls: False) if mode.endswith("fwad-mlp") else plain_mlp
                with P.keeping_layers(model.truth, dtype=torch.float64 if precision == "fp64" else torch.float32):
                    # the first builds (and keeps) the layers
                    times = _twice(device, lambda: P.probe_sequences(model.truth, seqs, targets, probes,
                                                                     precision=precision))
                    if profile and mode == "fp32-bf16":
                        _profile(device, lambda: P.probe_sequences(model.truth, seqs, targets, probes,
                                                                   precision=precision))
            rows.append({"shape": f"{n}x{t}", "mode": mode, "first_s": times[0], "kept_s": times[1],
                         "ms_per_token": 1e3 * times[1] / (n * t)})
            print(rows[-1], flush=True)
    pass_.TANGENT_GEMM, pass_._plain_mlp = torch.bfloat16, plain_mlp
    return rows


def table(rows: list[dict]) -> str:
    base = {r["shape"]: r["kept_s"] for r in rows if r["mode"] == "fp64"}
    base = base or {r["shape"]: r["kept_s"] for r in rows if r["mode"] == "fp32-bf16-fwad-mlp"}
    out = ["| sequences x rows | precision | first pass s | kept s | ms per token | baseline / this |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{base[r['shape']] / r['kept_s']:.1f}" if r["shape"] in base else ""
        out.append(f"| {r['shape']} | {r['mode']} | {r['first_s']:.1f} | {r['kept_s']:.1f} | "
                   f"{r['ms_per_token']:.1f} | {ratio} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None, help="default: the fixture dense-nvfp4_awq-a")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--shapes", default="7x79,1x2047")
    ap.add_argument("--probes", type=int, default=64)
    ap.add_argument("--modes", default="fp64,fp32-bf16,fp32-tf32")
    ap.add_argument("--profile", action="store_true", help="also the time by kernel of one fp32-bf16 pass")
    a = ap.parse_args()
    from reference_impl.truth.engine import default_device

    if a.checkpoint is None:
        from fixtures.make_checkpoints import ensure_checkpoints

        a.checkpoint = str(ensure_checkpoints() / "dense-nvfp4_awq-a")
    device = a.device or default_device()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    rows = measure(a.checkpoint, device, shapes, a.probes, a.modes.split(","), a.profile)
    print(f"\n{a.checkpoint} on {device}, {a.probes} probes")
    print(table(rows))


if __name__ == "__main__":
    main()
