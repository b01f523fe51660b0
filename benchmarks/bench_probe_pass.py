"""Time per judged token of the truth's probed passes (reference_impl/truth/probes.py) by precision, measured in
the same run on the same sequences: the fp64 forward of the values alone (``values``), fp64, fp32 with BF16
tangent GEMMs (the default of ``fp32``) and with TF32 ones, with the dense MLP through forward_ad instead of by
hand (``fp32-bf16-fwad-mlp``; the speed column's baseline when fp64 is not run), with the probed attention by
the CUDA kernels instead of eager passes (``fp32-bf16-attention-kernel``, ``TRUTH_ATTENTION_KERNEL=1``) and with
each store's draw and add by the CUDA kernel (``fp32-bf16-store-kernel``, ``TRUTH_STORE_KERNEL=1``, the truth's
default on CUDA), and with the probed softmax's two stores fused as well (``fp32-bf16-softmax-kernel``,
``TRUTH_SOFTMAX_KERNEL=1``); every other mode draws eagerly; the last column: the summed variance estimates against
``fp32-bf16``'s, other draws of the same distribution), each with the
decoder layers kept between passes (``keeping_layers``; the first pass, which builds them, timed apart).
Optionally the GPU time by kernel of one pass of a mode (``--profile``, ``--profile-mode``).

    python benchmarks/bench_probe_pass.py --checkpoint /tmp/m8b --device cuda --shapes 7x79,1x2047

A shape ``NxT``: N sequences of T rows (prompt + continuation - 1), judged in one call (sequences of one length
share passes)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.timing import synchronize as _sync, wall_times  # noqa: E402


def _profile(device: str, run, rows: int = 20) -> None:
    """The time by kernel (CUDA) or operator (CPU) of one call of ``run``; on CUDA also by operator and input
    shapes (which operation launched the time: casts, draws, products)."""
    from torch.profiler import ProfilerActivity, profile as prof

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with prof(activities=acts, record_shapes=cuda) as p:
        run()
        _sync(device)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(p.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=90))
    if cuda:
        print(p.key_averages(group_by_input_shape=True).table(sort_by="cuda_time_total", row_limit=2 * rows,
                                                               max_name_column_width=40, max_shapes_column_width=90))


def measure(checkpoint: str, device: str, shapes: list[tuple[int, int]], probes: int, modes: list[str],
            profile: int = 0, max_rows: int | None = None, profile_mode: str = "fp32-bf16") -> list[dict]:
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
                times, _ = wall_times(device, lambda: pass_.values_fp64(model.truth, [(seqs, targets)]))
                estimate = float("nan")
            else:
                precision, gemm = {"fp64": ("fp64", None), "fp32-bf16": ("fp32", torch.bfloat16),
                                   "fp32-tf32": ("fp32", None), "fp32-bf16-fwad-mlp": ("fp32", torch.bfloat16),
                                   "fp32-bf16-attention-kernel": ("fp32", torch.bfloat16),
                                   "fp32-bf16-store-kernel": ("fp32", torch.bfloat16),
                                   "fp32-bf16-softmax-kernel": ("fp32", torch.bfloat16)}[mode]
                # the CUDA kernels (reference_impl/truth/attention_kernel.py, store_kernel.py) in their modes only
                kernels = {"TRUTH_ATTENTION_KERNEL": "1" if mode.endswith("attention-kernel") else "0",
                           "TRUTH_STORE_KERNEL": "1" if mode.endswith(("store-kernel", "softmax-kernel")) else "0",
                           "TRUTH_SOFTMAX_KERNEL": "1" if mode.endswith("softmax-kernel") else "0"}
                pass_.TANGENT_GEMM = gemm
                # fwad-mlp: the dense MLP through forward_ad, not by hand (what probe_pass._ProbedMLP saves)
                pass_._plain_mlp = (lambda cls: False) if mode.endswith("fwad-mlp") else plain_mlp
                if device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                with mock.patch.dict(os.environ, kernels), \
                        P.keeping_layers(model.truth, dtype=torch.float64 if precision == "fp64" else torch.float32):
                    # the first builds (and keeps) the layers
                    times, res = wall_times(device, lambda: P.probe_sequences(model.truth, seqs, targets, probes,
                                                                          precision=precision, max_rows=max_rows))
                    estimate = float(sum(r.logprob_var.sum() for r in res))  # (the draws differ by mode)
                    if profile and mode == profile_mode:
                        _profile(device, lambda: P.probe_sequences(model.truth, seqs, targets, probes,
                                                                   precision=precision, max_rows=max_rows), profile)
            peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.startswith("cuda") else float("nan")
            rows.append({"shape": f"{n}x{t}", "mode": mode, "first_s": times[0], "kept_s": times[1],
                         "ms_per_token": 1e3 * times[1] / (n * t), "peak_gib": peak, "estimate": estimate})
            print(rows[-1], flush=True)
    pass_.TANGENT_GEMM, pass_._plain_mlp = torch.bfloat16, plain_mlp
    return rows


def table(rows: list[dict]) -> str:
    base = {r["shape"]: r["kept_s"] for r in rows if r["mode"] == "fp64"}
    base = base or {r["shape"]: r["kept_s"] for r in rows if r["mode"] == "fp32-bf16-fwad-mlp"}
    ref = {r["shape"]: r["estimate"] for r in rows if r["mode"] == "fp32-bf16"}
    out = ["| sequences x rows | precision | first pass s | kept s | ms per token | peak GiB | baseline / this | "
           "sum of V_hat / fp32-bf16's |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{base[r['shape']] / r['kept_s']:.1f}" if r["shape"] in base else ""
        out.append(f"| {r['shape']} | {r['mode']} | {r['first_s']:.1f} | {r['kept_s']:.1f} | "
                   f"{r['ms_per_token']:.1f} | {r.get('peak_gib', float('nan')):.1f} | {ratio} | "
                   f"{r['estimate'] / ref.get(r['shape'], float('nan')):.3f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None, help="default: the fixture dense-nvfp4_awq-a")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--shapes", default="7x79,1x2047")
    ap.add_argument("--probes", type=int, default=64)
    ap.add_argument("--modes", default="fp64,fp32-bf16,fp32-tf32")
    ap.add_argument("--profile", type=int, nargs="?", const=20, default=0, metavar="ROWS",
                    help="also the time by kernel (and on CUDA by operator and shapes) of one pass of --profile-mode")
    ap.add_argument("--profile-mode", default="fp32-bf16", help="the mode --profile profiles (one of --modes)")
    ap.add_argument("--max-rows", type=int, default=None,
                    help="rows of one probed pass at most (default: reference_impl.truth.probes.rows_budget)")
    ap.add_argument("--keep-share", type=float, default=None,
                    help="the share of the truth device's memory the kept fp32 layers may take (default: "
                         "reference_impl/truth/probe_pass.py KEEP_SHARE)")
    a = ap.parse_args()
    if a.keep_share is not None:
        from reference_impl.truth import probe_pass

        probe_pass.KEEP_SHARE = a.keep_share
    from reference_impl.truth.engine import default_device

    if a.checkpoint is None:
        from fixtures.make_checkpoints import ensure_checkpoints

        a.checkpoint = str(ensure_checkpoints() / "dense-nvfp4_awq-a")
    device = a.device or default_device()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s]
    if a.profile and a.profile_mode not in a.modes.split(","):
        ap.error(f"--profile-mode {a.profile_mode}: not among --modes {a.modes}")
    rows = measure(a.checkpoint, device, shapes, a.probes, a.modes.split(","), a.profile, a.max_rows, a.profile_mode)
    print(f"\n{a.checkpoint} on {device}, {a.probes} probes")
    print(table(rows))


if __name__ == "__main__":
    main()
