"""The fp32-accumulating W4A16 fused MoE of :mod:`reference_impl.moe`, evaluated as bf16 grouped GEMMs.

Same math as the per-expert description there, per (token, slot) pair routed to a local expert ``e``:
``g = (x @ Wg_e^T) * s_gate_e``, ``u = (x @ Wu_e^T) * s_up_e`` (fp32 accumulators, one fp32 multiply),
``h = bf16(act(g, u))`` (activation in fp32), ``o = (h @ W2_e^T) * s_2_e``, contribution ``o * w`` (fp32),
and per token the sum of its contributions over its top-k slots in slot order (fp32), rounded once.

* ``W = e2m1 * e4m3`` is decoded once into bf16, exactly (:func:`reference_impl.format.nvfp4.codes_times_block_scales`),
  so a bf16 GEMM with fp32 accumulation and fp32 output computes the same fp32 sum of exact products as an
  fp32 GEMM on the decoded weights.
* Pairs are sorted by expert (one stable ``sort``; no per-token Python loop) and each GEMM is one grouped
  GEMM over the experts' segments: on CUDA a Triton kernel (:mod:`reference_impl.moe._triton_grouped_gemm`,
  fp32 output, decode scale and routing weight fused in its epilogue); on CUDA without Triton one
  ``torch.mm(..., out_dtype=torch.float32)`` (cuBLAS) per expert that has tokens; elsewhere (CPU) one
  :func:`reference_impl.dense.exact_dot.exact_matmul_fp32` per expert that has tokens (the exact sum of the exact
  products, rounded once to fp32), then the same fp32 epilogue multiplies.
* The combine writes each contribution to its (token, slot) row and adds the ``top_k`` rows of a token in
  slot order, one elementwise fp32 add per slot: no atomics, no reduction kernel, whatever order the
  experts ran in.

Determinism, by construction: the same prepared experts and inputs give the same bits on every call. On
CPU no sum depends on an order (:mod:`reference_impl.dense.exact_dot`; a CPU BLAS may pick its K-sum order per
call, so per-expert fp32 GEMMs are not reproducible there); results are also independent of which experts
were prepared, in which order, and of the token chunking. On CUDA the Triton kernel's tiles are fixed by the
launch (:func:`reference_impl.moe._triton_grouped_gemm.pick_config`: a function of the rows and experts only),
each program owns its output tile and sums K in one loop over ``BLOCK_K`` steps (no split-K, no atomics);
cuBLAS (no-Triton path) is run-to-run reproducible on one GPU model and toolkit (docs/moe.md). CUDA and CPU
results may differ from each other: both are within the bound.
* On the Triton path nothing synchronizes with the host, so calls with at most ``GRAPH_MAX_PAIRS`` pairs
  replay a CUDA graph of the whole layer (captured on the first call of each input shape): at decode sizes
  the GPU work is tens of microseconds and ~30 kernel launches from Python would otherwise dominate.

Measured on an H200 (``benchmarks/bench_moe.py``, against a BF16 MoE built from ``torch._grouped_mm`` on the
same routing): Mixtral-like (8 x 4096x14336, top-2) 0.43x-1.26x, DeepSeek-like (256 x 7168x2048, top-8)
0.59x-0.81x at T in {1, 16, 256, 4096}.

Memory: the prepared experts are one bf16 copy of the local experts' weights. A call processes the tokens in
chunks of ``T_c`` tokens with ``T_c * top_k * max(2I, H) * 4 <= MOE_CHUNK_BYTES`` (1 GiB): the GEMM1 output
(fp32 ``[pairs, 2I]``), the bf16 intermediate (``[pairs, I]``) and the fp32 combine rows (``[T_c * top_k,
H]``) are each at most one such chunk.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from reference_impl.dense import uses_cublas_fp32_gemm
from reference_impl.dense.exact_dot import exact_matmul_fp32
from reference_impl.moe.experts import NVFP4Experts, apply_activation, is_gated, local_expert_offset
from reference_impl.format.nvfp4 import codes_times_block_scales

MOE_CHUNK_BYTES = 1 << 30
#: Weights (w13 + w2) up to which the exact (CPU) path keeps an fp64 upcast next to the bf16 copy (128 MiB).
FP64_KEEP_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class PreparedExperts:
    """Local experts decoded for grouped bf16 GEMMs. ``w13 [E', R, H]`` bf16 (``R = 2I`` halves ``[gate;
    up]``, ``I`` for relu2), ``w2 [E', H, I]`` bf16, both ``e2m1 * e4m3`` exactly; per prepared expert the
    fp32 decode scales ``scale_gate``, ``scale_up``, ``scale_down`` ``[E']``. ``slot_of_local [E_local]``
    maps a local expert to its prepared index (-1: not prepared; a one-shot call prepares only the experts
    its tokens use)."""

    w13: torch.Tensor
    w2: torch.Tensor
    scale_gate: torch.Tensor
    scale_up: torch.Tensor
    scale_down: torch.Tensor
    slot_of_local: torch.Tensor
    expert_offset: int
    activation: str
    activation_params: dict = field(default_factory=dict)
    #: The exact path's fp64 upcasts (``w13``, ``w2``), kept when small (see :func:`prepare_experts`).
    fp64_weights: tuple[torch.Tensor, torch.Tensor] | None = None
    #: Not every local expert at its own index (a one-shot call's subset, or another order): runs map ids
    #: through ``slot_of_local`` and check that no pair needs an expert that was not prepared.
    partial: bool = False
    #: CUDA graphs of small calls, by input signature (see :func:`_run_graphed`).
    graphs: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def gated(self) -> bool:
        return is_gated(self.activation)

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]


def routed_local_experts(topk_ids: torch.Tensor, experts: NVFP4Experts) -> list[int]:
    """The local experts (sorted) that at least one (token, slot) pair of ``topk_ids`` is routed to."""
    local = topk_ids.long().reshape(-1) - local_expert_offset(experts)
    local = local[(local >= 0) & (local < experts.num_local_experts)]
    return torch.unique(local).tolist()


def prepare_experts(experts: NVFP4Experts, local_experts: Sequence[int] | None = None) -> PreparedExperts:
    """Decode ``local_experts`` (default: all) of ``experts`` into a :class:`PreparedExperts`, on the
    experts' device. The one bf16 copy is the only lasting extra memory."""
    num_local = experts.num_local_experts
    device = experts.w13.device
    ids = list(range(num_local)) if local_experts is None else [int(e) for e in local_experts]
    if any(not 0 <= e < num_local for e in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"local experts {ids} must be distinct and in [0, {num_local})")
    index = torch.tensor(ids, dtype=torch.long, device=device)
    everything = local_experts is None

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if everything else t.index_select(0, index)

    s13 = pick(experts.w13_scale_2.to(device)).float()
    s13 = s13.reshape(len(ids), -1) if s13.numel() else s13.reshape(0, 1)
    gated = is_gated(experts.activation)
    slot_of_local = torch.full((num_local,), -1, dtype=torch.long, device=device)
    slot_of_local[index] = torch.arange(len(ids), device=device)
    w13 = codes_times_block_scales(pick(experts.w13), pick(experts.w13_scale))
    w2 = codes_times_block_scales(pick(experts.w2), pick(experts.w2_scale))
    # The exact path upcasts weights to fp64; keep the upcast when it is one chunk or less.
    small = w13.numel() + w2.numel() <= FP64_KEEP_ELEMENTS and device.type != "cuda"
    return PreparedExperts(
        w13=w13,
        w2=w2,
        scale_gate=s13[:, 0].contiguous(),
        scale_up=(s13[:, -1] if gated else s13[:, 0]).contiguous(),
        scale_down=pick(experts.w2_scale_2.to(device)).float().reshape(-1).contiguous(),
        slot_of_local=slot_of_local,
        expert_offset=local_expert_offset(experts),
        activation=experts.activation,
        activation_params=dict(experts.activation_params),
        fp64_weights=(w13.double(), w2.double()) if small else None,
        partial=ids != list(range(num_local)),
    )


def run_prepared_experts(
    prepared: PreparedExperts,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    round_intermediate: bool = True,
) -> torch.Tensor:
    """This rank's W4A16 MoE output ``[T, H]`` in ``out_dtype`` (module docstring). ``x [T, H]`` bf16,
    ``topk_ids [T, k]`` global ids, ``topk_weights [T, k]``."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != prepared.hidden_size:
        raise TypeError(f"hidden states must be bfloat16 [T, {prepared.hidden_size}], got {x.dtype} {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids/topk_weights must both be [T={x.shape[0]}, top_k], got "
                         f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}")
    if _graphable(prepared, x, topk_ids):
        return _run_graphed(prepared, x, topk_ids, topk_weights, out_dtype, round_intermediate)
    return _run_eager(prepared, x, topk_ids, topk_weights, out_dtype, round_intermediate)


def _run_eager(prepared: PreparedExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               out_dtype: torch.dtype, round_intermediate: bool) -> torch.Tensor:
    tokens, top_k = topk_ids.shape
    num_local = prepared.slot_of_local.numel()
    local = topk_ids.to(x.device).long() - prepared.expert_offset
    owned = (local >= 0) & (local < num_local)
    if prepared.partial:  # a one-shot subset: map to prepared indices, and check (a host sync)
        slot = torch.where(owned, prepared.slot_of_local[local.clamp(0, num_local - 1)], -1)
        if bool((owned & (slot < 0)).any()):
            raise ValueError("some (token, slot) pairs are routed to local experts that were not prepared")
        key = torch.where(slot >= 0, slot, prepared.w13.shape[0])
    else:
        key = torch.where(owned, local, num_local)
    weights = topk_weights.to(device=x.device, dtype=torch.float32)
    out = torch.empty(tokens, prepared.hidden_size, dtype=out_dtype, device=x.device)
    width = max(prepared.w13.shape[1], prepared.hidden_size)
    step = max(1, MOE_CHUNK_BYTES // (top_k * width * 4))
    for t0 in range(0, tokens, step):
        t1 = min(t0 + step, tokens)
        out[t0:t1] = _run_chunk(prepared, x[t0:t1], key[t0:t1], weights[t0:t1], round_intermediate)
    return out


def _run_chunk(prepared: PreparedExperts, x: torch.Tensor, key: torch.Tensor, weights: torch.Tensor,
               round_intermediate: bool) -> torch.Tensor:
    """fp32 ``[T_c, H]`` for one chunk of tokens (``key [T_c, k]``: prepared expert per pair, ``E'`` = none).

    No host synchronization on the Triton path: buffers are sized for all ``T_c * k`` pairs (pairs not
    routed here sort last and fall in no expert's segment, so no GEMM reads or writes their rows; their
    combine rows stay zero)."""
    tokens, top_k = key.shape
    pairs = tokens * top_k
    num_experts, hidden, inter = prepared.w13.shape[0], prepared.hidden_size, prepared.intermediate_size
    sorted_key, sorted_pairs = torch.sort(key.reshape(-1), stable=True)
    bounds = torch.searchsorted(sorted_key, _arange(num_experts + 1, x.device))  # segment starts, then the unowned
    seg_start = bounds[:-1]
    counts = bounds[1:] - seg_start
    combined = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    if not pairs or not num_experts:
        return _sum_slots(combined, tokens, top_k)
    w13_f, w2_f = prepared.fp64_weights or (None, None)
    g = _grouped_fp32(x, prepared.w13, counts, seg_start, pairs, prepared.scale_gate, prepared.scale_up,
                      inter if prepared.gated else prepared.w13.shape[1], a_rows=sorted_pairs // top_k, w_fp64=w13_f)
    h = apply_activation(prepared.activation, g[:, :inter], g[:, inter:] if prepared.gated else None,
                         prepared.activation_params)
    del g
    if round_intermediate:
        h = h.to(torch.bfloat16)
    _grouped_fp32(h, prepared.w2, counts, seg_start, pairs, prepared.scale_down, prepared.scale_down, hidden,
                  out=combined, out_rows=sorted_pairs, row_scale=weights.reshape(-1)[sorted_pairs], w_fp64=w2_f)
    return _sum_slots(combined, tokens, top_k)


def _sum_slots(combined: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """Per token, its ``top_k`` contribution rows added in slot order (one elementwise add per slot)."""
    rows = combined.view(tokens, top_k, -1)
    total = rows[:, 0].clone()
    for slot in range(1, top_k):
        total += rows[:, slot]
    return total


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


# ----------------------------------------------------------------------------------------- CUDA graphs
#: Calls with at most this many (token, slot) pairs replay a CUDA graph of the whole MoE on CUDA: there the
#: GPU work is tens of microseconds and launching ~30 small kernels from Python would dominate.
GRAPH_MAX_PAIRS = 1024
GRAPHS_PER_LAYER = 8


def _graphable(prepared: PreparedExperts, x: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    return (x.device.type == "cuda" and not prepared.partial and _triton_ok(x.device)
            and 0 < topk_ids.numel() <= GRAPH_MAX_PAIRS and not torch.cuda.is_current_stream_capturing())


def _run_graphed(prepared: PreparedExperts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 out_dtype: torch.dtype, round_intermediate: bool) -> torch.Tensor:
    """The same kernels as :func:`_run_eager`, captured once per input signature and replayed: the first
    call runs eagerly (which also compiles the kernels) and captures; later calls copy the inputs into the
    captured buffers and replay. The result is a fresh tensor (a copy of the graph's output buffer)."""
    key = (tuple(x.shape), topk_ids.dtype, tuple(topk_ids.shape), topk_weights.dtype, out_dtype,
           round_intermediate, x.device)
    graphs = prepared.graphs
    entry = graphs.get(key)
    if entry is None:
        out = _run_eager(prepared, x, topk_ids, topk_weights, out_dtype, round_intermediate)
        static = (x.clone(), topk_ids.to(x.device).clone(), topk_weights.to(x.device).clone())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = _run_eager(prepared, *static, out_dtype, round_intermediate)
        if len(graphs) >= GRAPHS_PER_LAYER:
            graphs.pop(next(iter(graphs)))
        graphs[key] = (graph, static, static_out)
        return out
    graph, (sx, sids, sw), static_out = entry
    sx.copy_(x)
    sids.copy_(topk_ids)
    sw.copy_(topk_weights)
    graph.replay()
    return static_out.clone()


# ----------------------------------------------------------------------------------------- grouped GEMM
def _triton_ok(device: torch.device) -> bool:
    return device.type == "cuda" and _triton_importable()


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _fp32_out_gemm(device: torch.device) -> bool:
    return uses_cublas_fp32_gemm(device)


def _grouped_fp32(a, w, counts, seg_start, rows, scale_a, scale_b, split, *, a_rows=None, out=None,
                  out_rows=None, row_scale=None, w_fp64=None) -> torch.Tensor:
    """Row ``j`` of expert ``e``'s segment: ``(a[a_rows[j]] @ w[e]^T) * col_scale * row_scale[j]`` in fp32,
    stored to ``out[out_rows[j]]`` (``out`` defaults to a new ``[rows, N]``). ``col_scale`` is
    ``scale_a[e]`` for columns ``< split``, ``scale_b[e]`` after."""
    n = w.shape[1]
    if out is None:
        out = torch.empty(rows, n, dtype=torch.float32, device=a.device)
    if a.dtype == torch.bfloat16 and _triton_ok(a.device):
        from reference_impl.moe._triton_grouped_gemm import grouped_gemm

        return grouped_gemm(a, w, counts, seg_start, rows, scale_a, scale_b, split, out, a_rows=a_rows,
                            out_rows=out_rows, row_scale=row_scale)
    columns = torch.arange(n, device=a.device) < split
    cublas = a.dtype == torch.bfloat16 and _fp32_out_gemm(a.device)
    for e, (start, count) in enumerate(zip(seg_start.tolist(), counts.tolist())):
        if not count:
            continue
        rows_e = slice(start, start + count)
        ae = a[a_rows[rows_e]] if a_rows is not None else a[rows_e]
        if cublas:
            acc = torch.mm(ae, w[e].T, out_dtype=torch.float32)
        else:
            acc = exact_matmul_fp32(ae, w_fp64[e] if w_fp64 is not None else w[e])
        acc = acc * torch.where(columns, scale_a[e], scale_b[e])
        if row_scale is not None:
            acc = acc * row_scale[rows_e].unsqueeze(-1)
        if out_rows is not None:
            out[out_rows[rows_e]] = acc
        else:
            out[rows_e] = acc
    return out
