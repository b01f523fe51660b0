"""The truth's fused store kernel (reference_impl/truth/store_kernel.py, CUDA) run by Triton's CPU interpreter:
``upstream + std z`` with ``z`` independent standard normals -- the upstream exact, each sequence's ``std`` for
its own replicas, the draws' moments and independence (between replicas, neighbours and calls) within derived
bounds; mutants of each property caught by the same check."""
from __future__ import annotations

import textwrap

import pytest
import torch

from reference_impl.truth import store_kernel
from reference_impl.truth.stores import U_BF16
from tests.reference.triton_interpreter import run_script

S, K, INNER = 3, 4, 5003  # 5003: not a multiple of a program's 4 x 1024 elements (the masks)

SCRIPT = textwrap.dedent('''
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from reference_impl.truth.store_kernel import draw_add
    S, K, INNER = (int(x) for x in sys.argv[2:5])
    g = torch.Generator().manual_seed(0)
    std = torch.rand(S, INNER, generator=g) * 3 + 0.5
    std[0] = 0  # sequence 0 draws nothing: its replicas are their upstream, exactly
    upstream = torch.randn(S * K, INNER, generator=g).to(torch.bfloat16)
    torch.save({"std": std, "upstream": upstream,
                "out": draw_add(upstream, std, S * K, torch.float32, 5),
                "again": draw_add(None, std, S * K, torch.float32, 6),  # another key, no upstream
                "bf16": draw_add(upstream, std, S * K, torch.bfloat16, 5)}, sys.argv[1])
    # through the probes (the kernel made available on this CPU): a dense linear's store, weight term included
    from reference_impl.truth import probe_draws, store_kernel
    from reference_impl.truth.stores import store_std
    store_kernel.available = lambda one, std: one.dtype == torch.float32 and std.shape[0] <= store_kernel.MAX_SEQUENCES
    S2, K2, T, N, KIN = 2, 256, 3, 64, 32
    x, w = torch.randn(S2 * T, KIN, generator=g), torch.randn(N, KIN, generator=g)
    one = (x @ w.T).view(S2, T, N)
    up = torch.randn(S2 * K2, T, N, generator=g)
    probe = probe_draws.Probe(K2, T, generator=torch.Generator().manual_seed(2), sequences=S2)
    torch.save({"out": probe.store_tangent("linear", one, up, (x, w), KIN, shared=True), "upstream": up,
                "std": store_std("linear", one, (x, w), KIN, False)[0], "x": x, "w": w, "replicas": K2},
               sys.argv[1] + ".linear")
''')


def check_draws(out: torch.Tensor, upstream: torch.Tensor | None, std: torch.Tensor) -> list[str]:
    """What is wrong with ``out`` as ``upstream + std z`` (``std`` ``[S, n]`` per sequence, ``out`` ``[S K, n]``),
    ``z`` i.i.d. N(0, 1): [] if nothing. Bounds at 6 standard errors of each statistic over ``m`` normals (false
    failure ~2e-9 each): the mean's sd ``1/sqrt(m)``, the variance's ``sqrt(2/m)``, the fourth moment's
    ``sqrt(96/m)`` (Var z^4 = 105 - 9), a correlation's ``1/sqrt(m)``."""
    s_, n = std.shape
    k = out.shape[0] // s_
    base = upstream.float() if upstream is not None else torch.zeros_like(out, dtype=torch.float32)
    diff = (out.float() - base).view(s_, k, n)
    problems = []
    zero = std == 0
    if bool((diff[zero[:, None].expand_as(diff)] != 0).any()):
        problems.append("a zero std drew")
    live = ~zero[:, 0]
    z = (diff[live] / std[live][:, None]).double()  # [S', K, n]
    m = z.numel()
    bound = 6 / m ** 0.5
    if abs(float(z.mean())) > bound:
        problems.append(f"mean {float(z.mean()):.4f}")
    if abs(float(z.pow(2).mean()) - 1) > 6 * (2 / m) ** 0.5:
        problems.append(f"variance {float(z.pow(2).mean()):.4f}")
    if abs(float(z.pow(4).mean()) - 3) > 6 * (96 / m) ** 0.5:
        problems.append(f"fourth moment {float(z.pow(4).mean()):.4f} (a normal's: 3)")
    pairs = {"replicas": (z[:, 0], z[:, 1]), "neighbours": (z[..., :-1], z[..., 1:])}
    if n >= 2048:
        pairs["a program's four blocks"] = (z[..., :1024], z[..., 1024:2048])
    for name, (a, b) in pairs.items():
        corr = float((a * b).mean())
        if abs(corr) > 6 / a.numel() ** 0.5:
            problems.append(f"{name} correlated ({corr:.4f})")
    return problems


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> dict:
    path = run_script(SCRIPT, tmp_path_factory.mktemp("store") / "drawn.pt", S, K, INNER)
    return {**torch.load(path), "linear": torch.load(str(path) + ".linear")}


def test_the_kernel_adds_independent_normals_scaled_by_each_sequences_std(drawn) -> None:
    assert check_draws(drawn["out"], drawn["upstream"], drawn["std"]) == []
    assert check_draws(drawn["again"], None, drawn["std"]) == []


def test_another_key_draws_other_numbers_and_bf16_rounds_once(drawn) -> None:
    a, b = drawn["out"].float() - drawn["upstream"].float(), drawn["again"]
    live = slice(K, None)  # sequence 0's std is 0
    assert abs(float((a[live] * b[live]).mean() / (a[live].std() * b[live].std()))) < 6 / a[live].numel() ** 0.5
    # the BF16 output: the fp32 sum (the same key: the same draws) rounded once, within one BF16 unit (Triton's
    # interpreter truncates an fp32 -> bf16 cast, a GPU rounds to nearest even)
    exact = drawn["out"]
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().to(torch.bfloat16).float()
    assert bool(((drawn["bf16"].float() - exact).abs() <= ulp).all())


@pytest.mark.parametrize("mutant", ["one draw for every replica", "the std of the next sequence",
                                    "uniform draws", "variance 2", "upstream dropped", "neighbours shared"])
def test_the_check_catches(drawn, mutant: str) -> None:
    std, upstream = drawn["std"], drawn["upstream"]
    g = torch.Generator().manual_seed(1)
    z = torch.randn(S, K, INNER, generator=g)
    if mutant == "one draw for every replica":
        z = z[:, :1].expand_as(z)
    elif mutant == "uniform draws":
        z = (torch.rand(z.shape, generator=g) - 0.5) * 12 ** 0.5  # mean 0, variance 1, not normal
    elif mutant == "variance 2":
        z = z * 2 ** 0.5
    elif mutant == "neighbours shared":
        z = z.repeat_interleave(2, dim=-1)[..., :INNER]
    scale = std.roll(1, 0) if mutant == "the std of the next sequence" else std
    out = (z * scale[:, None]).reshape(S * K, INNER)
    if mutant != "upstream dropped":
        out = out + upstream.float()
    assert check_draws(out, upstream, std) != []
    # the check itself passes the same construction done right
    right = (torch.randn(S, K, INNER, generator=g) * std[:, None]).reshape(S * K, INNER) + upstream.float()
    assert check_draws(right, upstream, std) == []


def test_the_kernel_is_off_on_a_cpu_and_where_turned_off(monkeypatch) -> None:
    one = torch.zeros(2, 3)
    monkeypatch.delenv("TRUTH_STORE_KERNEL", raising=False)
    assert not store_kernel.available(one, one)  # a CPU tensor, whatever the switch
    if torch.cuda.is_available():
        gpu = one.cuda()
        monkeypatch.setenv("TRUTH_STORE_KERNEL", "0")
        assert not store_kernel.available(gpu, gpu)


def test_a_kernel_that_fails_to_launch_leaves_eager_draws(monkeypatch) -> None:
    """A Triton that cannot compile the kernel: one warning, None (the caller's eager draws), never tried again in
    the process; through the probes, the store's tangent drawn eagerly."""
    from reference_impl.truth import probe_draws

    def fails(*args):
        raise RuntimeError("PTX assembly failed")
    monkeypatch.setattr(store_kernel, "_broken", [])
    monkeypatch.setattr(store_kernel, "draw_add", fails)
    monkeypatch.setattr(store_kernel, "available", lambda one, std: not store_kernel._broken)
    probe = probe_draws.Probe(4, 3, generator=torch.Generator().manual_seed(0), sequences=2)
    one, up = torch.rand(2, 3, 5) + 1, torch.zeros(8, 3, 5)
    with pytest.warns(RuntimeWarning, match="PTX assembly failed"):
        out = probe.store_tangent("round", one, up, None, 0)
    assert store_kernel._broken and check_draws(out.view(8, -1), up.view(8, -1), U_BF16 * one.view(2, -1)) == []
    assert probe.store_tangent("round", one, up, None, 0).shape == out.shape  # no second warning: not tried


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton's compiled kernel)")
def test_the_kernel_on_a_gpu() -> None:
    """The compiled kernel: the same draws' check; its BF16 output the fp32 sum rounded to nearest even."""
    g = torch.Generator(device="cuda").manual_seed(0)
    std = torch.rand(3, 500003, generator=g, device="cuda") * 3 + 0.5
    std[0] = 0
    up = torch.randn(12, 500003, generator=g, device="cuda").to(torch.bfloat16)
    out = store_kernel.draw_add(up, std, 12, torch.float32, 5)
    assert check_draws(out.cpu(), up.cpu(), std.cpu()) == []
    assert torch.equal(store_kernel.draw_add(up, std, 12, torch.bfloat16, 5), out.to(torch.bfloat16))


def _linear_variance_ratio(linear: dict, weight_term: bool) -> float:
    """The mean over a dense linear store's elements of the replicas' ``E[(out - upstream)^2]`` over the model's
    variance: its own rounding's ``std^2`` plus (``weight_term``) the BF16 weight rounding's ``U^2 x^2 |w|^2``."""
    k, std = linear["replicas"], linear["std"]
    s_, t, n = std.shape
    emp = (linear["out"] - linear["upstream"]).view(s_, k, t, n).double().pow(2).mean(1)
    var = std.double() ** 2
    if weight_term:
        var = var + (U_BF16 ** 2 * linear["x"].double() ** 2 @ linear["w"].double().T ** 2).view(s_, t, n)
    return float((emp / var).mean())


def test_through_the_probes_a_linear_store_keeps_its_weight_term(drawn) -> None:
    """``Probe.store_tangent`` with the kernel: the replicas' variance is the store's plus the weight term's. The
    weight draws are shared by a column's tokens and by the sequences, so the independent chi^2 variables are the
    ``K N`` columns: the mean ratio's sd is at most ``sqrt(2 / (K N))`` (0.011 here), the bound 6 of them; without
    the weight term the ratio is about 0.5 (the term is as large as the store's own on random data)."""
    linear = drawn["linear"]
    bound = 6 * (2 / (linear["replicas"] * linear["std"].shape[-1])) ** 0.5
    assert abs(_linear_variance_ratio(linear, weight_term=True) - 1) < bound
    assert abs(_linear_variance_ratio(linear, weight_term=False) - 1) > bound  # the check sees the term
