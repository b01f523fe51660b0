"""The truth's probed-attention kernels (reference_impl/truth/attention_kernel.py, CUDA) run by Triton's CPU
interpreter: without draws, exactly the eager path's arithmetic (softmax, its forward-mode tangent, ``p |v|``); with
draws, the per-element variance the rounding model gives the scores' and probabilities' stores."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from reference_impl.truth.attention_kernel import KernelConfig

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import os, math, sys
    DEVICE = sys.argv[1]
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    torch.set_default_device(DEVICE)
    TOL = 1e-5 if DEVICE == "cpu" else 1e-2  # fp32; on a GPU the products are TF32 (10 bits: ~1e-3 of the largest)
    from reference_impl.truth.attention_kernel import KernelConfig, probed_attention
    # the interpreter: small blocks (not dividing 37); a GPU: the configuration the truth runs, at each precision
    SMALL = (KernelConfig(16, 16, 4, 1, sys.argv[2]) if DEVICE == "cpu"
             else KernelConfig.from_environment()._replace(scores=sys.argv[2]))

    def causal_softmax(q1, k1, scale):
        t_q, t_k = q1.shape[-2], k1.shape[-2]
        causal = torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)
        return torch.softmax((q1 @ k1.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf")), -1)

    g = torch.Generator(device=DEVICE).manual_seed(0)
    S, K, H, T, D, SCALE = 2, 3, 2, 37, 16, 0.25
    q1, k1, v1 = (torch.randn(S, H, T, D, generator=g) for _ in range(3))
    qt, kt, vt = (torch.randn(S * K, H, T, D, generator=g) for _ in range(3))
    p = causal_softmax(q1, k1, SCALE)
    want_out, want_pav = p @ v1, p @ v1.abs()
    each = lambda x: x.reshape(S, K, *x.shape[1:])
    st = (each(qt) @ k1.transpose(-1, -2)[:, None] + q1[:, None] @ each(kt).transpose(-1, -2)) * SCALE
    pt = p[:, None] * (st - (p[:, None] * st).sum(-1, keepdim=True))  # forward-mode's softmax tangent
    want_ot = (pt @ v1[:, None] + p[:, None] @ each(vt)).reshape(S * K, H, T, D)
    # no draws: the kernels' arithmetic against the eager formulas (fp32, blocks of 16 not dividing 37)
    out, pav, ot = probed_attention(q1, k1, v1, qt, kt, vt, SCALE, 0.0, 0.0, 7, config=SMALL)
    for name, got, want in (("out", out, want_out), ("p|v|", pav, want_pav), ("tangent", ot, want_ot)):
        err = float((got - want).abs().max() / want.abs().max())
        assert err < TOL, (name, err)
    # draws only (zero tangents): E[ot^2] per element against the model's variance
    reps, u, c = 240, 2.0 ** -8, 2e-3
    z = torch.zeros(reps, 1, 24, D)
    q, k, v = q1[:1, :1, :24], k1[:1, :1, :24], v1[:1, :1, :24]
    p = causal_softmax(q, k, SCALE)
    out = p @ v
    std = torch.hypot(u * (q @ k.transpose(-1, -2)) * SCALE, c * (q.abs() @ k.abs().transpose(-1, -2)) * SCALE)
    w = (p * std) ** 2
    scores_term = w @ v ** 2 - 2 * (w @ v) * out + w.sum(-1, keepdim=True) * out ** 2  # sum p^2 std^2 (v - out)^2
    round_term = u ** 2 * (p ** 2) @ v ** 2
    _, _, ot = probed_attention(q, k, v, z, z, z, SCALE, u, c, 11, config=SMALL)
    emp = ot.pow(2).mean(0, keepdim=True)
    for label, var in (("model", scores_term + round_term), ("no round store", scores_term),
                       ("no scores store", round_term)):
        # rows 1..23, independent (within a row the draws are shared); row 0 has one key: no scores term at all
        rows = (emp / var).mean(-1)[0, 0, 1:]
        print(label, float(rows.mean()), float(rows.min()), float(rows.max()))
    # through the probes (by_hand.probed_attention_kernel): a block of the probe's keys per call, one per
    # sequence, head and replica, no generator draw of its own
    import torch.autograd.forward_ad as fwAD
    from reference_impl.truth import by_hand, probe_draws, store_kernel
    probe = probe_draws.Probe(4, 24, generator=torch.Generator(device=DEVICE).manual_seed(3), sequences=1)
    with fwAD.dual_level():
        duals = [probe.join(x, torch.randn(4, 1, 24, D, generator=g)) for x in (q, k, v)]
        first = probe.keys(q.device)
        ot = fwAD.unpack_dual(by_hand.probed_attention_kernel(probe, *duals, SCALE, 24)).tangent
    # after the block of 1 sequence x 1 head x 4 replicas, the output store's key where the store kernel runs (CUDA)
    assert bool(torch.isfinite(ot).all()) and probe.keys.next == first + 1 + 4 + (DEVICE == "cuda"), \
        probe.keys.next - first
    assert first >= store_kernel.KEY_BASE
    print("ok")
''')


@pytest.mark.skipif(os.environ.get("NVFP4_SKIP_TRITON_INTERPRETER") == "1", reason="disabled by environment")
def test_probed_attention_kernels_under_the_interpreter() -> None:
    """The kernels' arithmetic and draws (:func:`_check`) run by Triton's CPU interpreter."""
    _check("cpu", KernelConfig().scores)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the kernels' own hardware)")
def test_probed_attention_kernels_on_a_gpu() -> None:
    """The same checks compiled for and run on the GPU, at every scores' precision (TF32 products: the exact
    comparison within 1e-2)."""
    for scores in ("ieee", "tf32x3", "tf32"):
        _check("cuda", scores)


def _check(device: str, scores: str) -> None:
    """Without draws, the kernels give the eager formulas' output, ``p |v|`` and tangent to fp32 rounding. With
    draws, ``K E[ot^2] / V ~ chi^2_K`` per element: a row's mean ratio has standard deviation at most
    ``sqrt(2 / K)`` (0.091 at K = 240; a row's elements share their draws, so no less), the mean of 23
    independent rows ``sqrt(2 / K / 23)`` (0.019). Both must hold within 5 of them; the same statistic against the
    variance of a kernel without the probabilities' store, or without the scores', is far outside."""
    pytest.importorskip("triton", reason="Triton not installed (it ships with CUDA torch builds)")
    done = subprocess.run([sys.executable, "-c", SCRIPT, device, scores], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
    stats = {line.rsplit(" ", 3)[0]: [float(x) for x in line.rsplit(" ", 3)[1:]]
             for line in done.stdout.splitlines() if line.startswith(("model", "no "))}
    row_sd, mean_sd = (2 / 240) ** 0.5, (2 / 240 / 23) ** 0.5
    mean, low, high = stats["model"]
    assert abs(mean - 1) <= 5 * mean_sd and 1 - 5 * row_sd <= low and high <= 1 + 5 * row_sd, stats
    for missing in ("no round store", "no scores store"):  # the statistic has the power to see either missing
        assert stats[missing][0] - 1 > 5 * mean_sd, stats
