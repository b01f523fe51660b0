"""The truth's fused softmax stores (reference_impl/truth/store_kernel.py ``softmax_stores``, CUDA) run by
Triton's CPU interpreter: a probed softmax's scores' store, ``p t``, its row sums and the probabilities' store in
one pass. Without draws the eager arithmetic; with draws the distribution the rounding model gives (each store's
own normals, the scores' shared by the tangent and its row sum), checked within derived bounds; mutants of each
property caught by the same check; through the probed attention, the output tangent's variance against the
model's."""
from __future__ import annotations

import textwrap

import pytest
import torch

from reference_impl.truth import store_kernel
from tests.reference.triton_interpreter import run_script

S, K, ROWS, TK, U = 2, 5, 200, 1100, 1.0  # K = 5: a tile's replica lanes partly masked; TK over several tiles

SCRIPT = textwrap.dedent('''
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from reference_impl.truth import store_kernel
    S, K, ROWS, TK = (int(x) for x in sys.argv[2:6]); U = float(sys.argv[6])
    g = torch.Generator().manual_seed(0)
    st = torch.randn(S, K, ROWS, TK, generator=g)
    p = torch.rand(S, ROWS, TK, generator=g)
    p[..., -7:] = 0  # masked keys: their tangent must be exactly 0
    std = torch.rand(S, ROWS, TK, generator=g) + 0.5
    got = {"st": st.clone(), "p": p, "std": std}
    plain = st.clone()  # no draws: the eager arithmetic
    got["plain_mean"] = store_kernel.softmax_stores(plain, p, torch.zeros_like(std), 0.0, 3)
    got["plain"] = plain
    drawn = st.clone()
    got["mean"] = store_kernel.softmax_stores(drawn, p, std, U, 5)
    got["out"] = drawn
    torch.save(got, sys.argv[1])
    # through the probed attention (the kernel made available on this CPU): zero input tangents, 240 replicas
    from reference_impl.truth import by_hand, probe_draws
    from reference_impl.truth.stores import U_ACCUM, U_BF16
    store_kernel.available = lambda one, std: one.dtype == torch.float32
    os.environ["TRUTH_SOFTMAX_KERNEL"] = "1"
    reps, d, t, scale = 240, 16, 24, 0.25
    q, k, v = (torch.randn(1, 1, t, d, generator=g) for _ in range(3))
    probe = probe_draws.Probe(reps, t, generator=torch.Generator().manual_seed(2), sequences=1)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = [probe.join(x, torch.zeros(reps, 1, t, d)) for x in (q, k, v)]
        ot = fwAD.unpack_dual(by_hand.probed_attention_block(probe, *dual, causal, scale, t)).tangent
    torch.save({"ot": ot, "q": q, "k": k, "v": v, "scale": scale, "u": U_BF16, "c": U_ACCUM * (d + 2),
                "c_out": U_ACCUM * (t + 2)}, sys.argv[1] + ".attention")
''')


def check_softmax(st: torch.Tensor, p: torch.Tensor, std: torch.Tensor, u: float, out: torch.Tensor,
                  mean: torch.Tensor) -> list[str]:
    """What is wrong with ``out``, ``mean`` as ``p (st + std z1) + u p z2`` and ``sum_j p (st + std z1)`` (``st``
    ``[S, K, R, T]``, ``p``, ``std`` ``[S, R, T]``; ``z1``, ``z2`` i.i.d. N(0, 1)): [] if nothing. Where ``p`` is 0
    the tangent is exactly 0. The tangent's noise over its standard deviation ``p sqrt(std^2 + u^2)``, and the
    row sums' over ``sqrt(sum p^2 std^2)``, must be standard normal (mean, variance, fourth moment) and
    uncorrelated between replicas, neighbours and a tile's two halves; the row sums' noise must correlate with
    the row's summed tangent noise as the shared ``z1`` makes it, ``rho = sum p^2 std^2 / sqrt(sum p^2 std^2
    sum p^2 (std^2 + u^2))``. Each within 6 standard errors (``1/sqrt(m)`` for a mean or a correlation,
    ``sqrt(2/m)`` for the variance, ``sqrt(96/m)`` for the fourth moment): false failure ~2e-9 each."""
    problems = []
    pp = p[:, None]
    noise = out - pp * st
    if bool((out[(pp == 0).expand_as(out)] != 0).any()):
        problems.append("a masked key's tangent is not 0")
    live = (pp > 0).expand_as(out)
    z = (noise / (pp * (std[:, None] ** 2 + u ** 2).sqrt()))
    row_var = (p ** 2 * std ** 2).sum(-1, keepdim=True)[:, None]
    zm = (mean - (pp * st).sum(-1, keepdim=True)) / row_var.sqrt()
    for name, x in (("tangent", z[live].double()), ("row sum", zm.double().flatten())):
        m = x.numel()
        if abs(float(x.mean())) > 6 / m ** 0.5:
            problems.append(f"{name} noise mean {float(x.mean()):.4f}")
        if abs(float(x.pow(2).mean()) - 1) > 6 * (2 / m) ** 0.5:
            problems.append(f"{name} noise variance {float(x.pow(2).mean()):.4f}")
        if name == "tangent" and abs(float(x.pow(4).mean()) - 3) > 6 * (96 / m) ** 0.5:
            problems.append(f"tangent noise fourth moment {float(x.pow(4).mean()):.4f}")
    zl = z[..., :-7].double()  # the live keys
    pairs = {"replicas": (zl[:, 0], zl[:, 1]), "neighbours": (zl[..., :-1], zl[..., 1:])}
    half = store_kernel.SOFTMAX_TILE // 8  # the kernel's tile: BLOCK columns at K = 5 (8 lanes)
    pairs["a tile's two halves"] = (zl[..., :half], zl[..., half:2 * half])
    for name, (a, b) in pairs.items():
        corr = float((a * b).mean())
        if abs(corr) > 6 / a.numel() ** 0.5:
            problems.append(f"{name} correlated ({corr:.4f})")
    total_var = (p ** 2 * (std ** 2 + u ** 2)).sum(-1, keepdim=True)[:, None]
    rho = row_var / (row_var * total_var).sqrt()
    zs = noise.sum(-1, keepdim=True) / total_var.sqrt()
    corr = float((zm * zs - rho).double().mean())
    if abs(corr) > 6 * (2 / zm.numel()) ** 0.5:  # Var(x y) <= 2 for unit normals, whatever their correlation
        problems.append(f"the row sum's draws are not the tangent's (correlation off by {corr:.4f})")
    return problems


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> dict:
    path = run_script(SCRIPT, tmp_path_factory.mktemp("softmax") / "drawn.pt", S, K, ROWS, TK, U)
    return {**torch.load(path), "attention": torch.load(str(path) + ".attention")}


def test_without_draws_the_eager_arithmetic(drawn) -> None:
    """std and u 0: ``p t`` exactly (one fp32 product) and its row sums to fp32 summation rounding (relative to
    the sum of magnitudes: at most ``T 2^-24`` of it in any order, 7e-5 at T = 1100)."""
    want = drawn["p"][:, None] * drawn["st"]
    assert torch.equal(drawn["plain"], want)
    err = (drawn["plain_mean"] - want.sum(-1, keepdim=True)).abs() / want.abs().sum(-1, keepdim=True)
    assert float(err.max()) < TK * 2.0 ** -24


def test_the_kernel_draws_the_two_stores(drawn) -> None:
    assert check_softmax(drawn["st"], drawn["p"], drawn["std"], U, drawn["out"], drawn["mean"]) == []


@pytest.mark.parametrize("mutant", ["the probabilities' store dropped", "the scores' noise not times p",
                                    "the row sum after the second store", "the row sum's own draws",
                                    "one draw for every replica", "a masked key drawn"])
def test_the_check_catches(drawn, mutant: str) -> None:
    st, p, std = drawn["st"], drawn["p"], drawn["std"]
    g = torch.Generator().manual_seed(1)
    z1, z2 = torch.randn(st.shape, generator=g), torch.randn(st.shape, generator=g)
    if mutant == "one draw for every replica":
        z1, z2 = z1[:, :1].expand_as(z1), z2[:, :1].expand_as(z2)
    pp, sd = p[:, None], std[:, None]
    first = pp * (st + sd * z1) if mutant != "the scores' noise not times p" else pp * st + sd * z1
    out = first + (U * pp * z2 if mutant != "the probabilities' store dropped" else 0)
    if mutant == "a masked key drawn":
        out = out + (pp == 0) * z2
    mean = first.sum(-1, keepdim=True)
    if mutant == "the row sum after the second store":
        mean = out.sum(-1, keepdim=True)
    elif mutant == "the row sum's own draws":
        mean = (pp * (st + sd * torch.randn(st.shape, generator=g))).sum(-1, keepdim=True)
    assert check_softmax(st, p, std, U, out, mean) != []
    z = torch.randn(st.shape, generator=g)  # the check passes the same construction done right
    right = pp * (st + sd * z)
    assert check_softmax(st, p, std, U, right + U * pp * torch.randn(st.shape, generator=g),
                         right.sum(-1, keepdim=True)) == []


def test_through_the_probed_attention_the_model_variance(drawn) -> None:
    """Zero input tangents, 240 replicas: ``K E[ot^2] / V ~ chi^2_K`` per element with ``V`` the scores' store
    through the softmax (``sum_j p^2 std^2 (v_j - out)^2``), the probabilities' (``u^2 sum_j p^2 v_j^2``) and the
    output's own (``hypot(u out, c_out p|v|)^2``); a row's elements share draws, so a row's mean ratio has sd at
    most ``sqrt(2/K)``, the mean of the 23 rows with more than one key ``sqrt(2/K/23)``: within 5 of them (as
    tests/reference/test_truth_attention_kernel.py); the variance without the softmax's two stores is far off."""
    a = drawn["attention"]
    q, k, v, scale, u = a["q"].double(), a["k"].double(), a["v"].double(), a["scale"], a["u"]
    t = q.shape[-2]
    s = q @ k.transpose(-1, -2) * scale
    p = torch.softmax(s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")), -1)
    out = p @ v
    std = torch.hypot(u * s, a["c"] * (q.abs() @ k.abs().transpose(-1, -2)) * scale)
    w = (p * std) ** 2
    scores_term = w @ v ** 2 - 2 * (w @ v) * out + w.sum(-1, keepdim=True) * out ** 2
    round_term = u ** 2 * (p ** 2) @ v ** 2
    out_term = torch.hypot(u * out, a["c_out"] * (p @ v.abs())) ** 2
    emp = a["ot"].double().pow(2).mean(0, keepdim=True)
    reps = a["ot"].shape[0]
    row_sd, mean_sd = (2 / reps) ** 0.5, (2 / reps / (t - 1)) ** 0.5
    rows = (emp / (scores_term + round_term + out_term)).mean(-1)[0, 0, 1:]
    assert abs(float(rows.mean()) - 1) <= 5 * mean_sd, rows
    assert 1 - 5 * row_sd <= float(rows.min()) and float(rows.max()) <= 1 + 5 * row_sd, rows
    without = (emp / out_term).mean(-1)[0, 0, 1:]
    assert float(without.mean()) - 1 > 5 * mean_sd  # the statistic sees the softmax's stores


def test_off_where_turned_off(monkeypatch) -> None:
    one = torch.zeros(2, 3)
    monkeypatch.setenv("TRUTH_SOFTMAX_KERNEL", "1")
    assert not store_kernel.softmax_available(one)  # a CPU tensor
    monkeypatch.setattr(store_kernel, "available", lambda one, std: True)
    assert store_kernel.softmax_available(one)
    monkeypatch.setenv("TRUTH_SOFTMAX_KERNEL", "0")
    assert not store_kernel.softmax_available(one)


def gpu_problems() -> list[str]:
    """The compiled kernel's draws on this process's CUDA device, by :func:`check_softmax`."""
    g = torch.Generator(device="cuda").manual_seed(0)
    st = torch.randn(S, K, ROWS, TK, generator=g, device="cuda")
    p = torch.rand(S, ROWS, TK, generator=g, device="cuda")
    p[..., -7:] = 0
    std = torch.rand(S, ROWS, TK, generator=g, device="cuda") + 0.5
    out = st.clone()
    mean = store_kernel.softmax_stores(out, p, std, U, 5)
    return check_softmax(*(x.cpu() for x in (st, p, std)), U, out.cpu(), mean.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton's compiled kernel)")
def test_the_kernel_on_a_gpu() -> None:
    assert gpu_problems() == []
