"""``bench_truth.py --workload NAME``: the truth of a workload's judged sequences (teacher forcing with
forward-mode probes, reference_impl/truth/probes.py) against its physical floor, measured in the same run.

The floor: the fp64 FLOPs of one teacher-forced forward and one backward pass (2x the forward) over every judged
token, over the device's measured fp64 GEMM rate, plus the checkpoint's bytes over the measured cold-read disk
rate. Forward FLOPs per sequence of T tokens: ``2 T P`` (P: the parameters of the linears a token passes,
LM head included; MoE: the routed and shared experts it reaches) plus attention ``2 * 2 * L * d * T (T + 1) / 2``
(scores and values, causal; d = heads x head dim).

The judged sequences: each prefill prompt with its continuation, the short-prompt pool (a correct engine gives a
prompt the same continuation in every batch, so the pool is judged once per weight set), the pool again on
weight set ``b`` and the longest prefill on ``b`` (the mixed traffic's long prompt is the prefill prompt of that
length). Continuations are random token ids (teacher forcing costs the same for any tokens).

The truth is run on ``chunk`` sequences of one length at a time (sharing probed passes), the first chunk of every
length, then the second, and so on, until ``--budget-s`` is spent; the projection for the whole workload takes
each length's measured seconds per floor FLOP (a length not reached: the nearest reached) times its floor FLOPs.
With ``--screen K1`` the truth is the screen's (reference_impl/truth/probes.py): ``K1`` probes per sequence,
what the verdict of an engine whose every check clears the screen costs; an answer that does not clear it costs
the rest of the probes on top (``probes / K1 - 1`` times its screen's time).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def judged_sequences(workload, vocab: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    g = torch.Generator().manual_seed(workload.seed)

    def cont() -> list[int]:
        return torch.randint(0, vocab, (workload.continuation,), generator=g).tolist()

    prefills = [(workload.prompts(vocab, n, 1, "prefill")[0], cont()) for n in workload.prefill_lengths]
    pool = [(p, cont()) for p in workload.prompts(vocab, workload.short_length, workload.pool_size, "pool")]
    longest = max(workload.prefill_lengths)
    # weight set b: the pool's prompts with continuations of their own (an engine on other weights generates
    # others; the same pairs would be memoised answers, judged for free)
    b_pool = [(p, cont()) for p, _ in pool[:max(workload.reload_batches)]]
    return {"a": prefills + pool, "b": b_pool + [(workload.prompts(vocab, longest, 1, "prefill")[0], cont())]}


def forward_flops(cfg: dict, tokens: int) -> float:
    h, L, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads", heads)
    attn_params = h * hd * (heads + 2 * kv) + heads * hd * h
    if cfg.get("num_experts") or cfg.get("n_routed_experts"):
        k = cfg.get("num_experts_per_tok", 1)
        mlp_params = 3 * h * cfg["moe_intermediate_size"] * (k + cfg.get("n_shared_experts", 0))
    else:
        mlp_params = 3 * h * cfg["intermediate_size"]
    linear = L * (attn_params + mlp_params) + h * v
    return 2.0 * tokens * linear + 2.0 * 2 * L * heads * hd * tokens * (tokens + 1) / 2


def gemm_rate(device: str, n: int = 4096) -> float:
    """Measured fp64 GEMM FLOP/s on ``device`` (the median time of conformance/perf's timer)."""
    from conformance.perf.measure import Timer

    a = torch.randn(n, n, dtype=torch.float64, device=device)
    b = torch.randn(n, n, dtype=torch.float64, device=device)
    return 2.0 * n ** 3 / Timer(torch.device(device)).median(lambda: a @ b)


def disk_rate(files: list[Path]) -> tuple[float, int]:
    """Cold read rate (bytes/s) of ``files`` and their total bytes."""
    from benchmarks.make_truth_models import drop_page_cache

    drop_page_cache(files)
    total, t = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return total / (time.perf_counter() - t), total


def _interleaved(groups: dict, chunk: int):
    """``(group, chunk of its sequences)``: the first chunk of every group (shortest first), then the second
    chunks, and so on, so a budget that stops early has measured every length it could reach."""
    keys = sorted(groups, key=lambda k: (k[1], k[0]))
    for lo in range(0, max(len(g) for g in groups.values()), chunk):
        for key in keys:
            if lo < len(groups[key]):
                yield key, groups[key][lo:lo + chunk]


def _projection(groups: dict, flops: dict, spent_by: dict, wall: float) -> float:
    """The whole workload's truth time: each group's measured seconds per floor FLOP times its floor FLOPs (a
    group not reached at the rate of the nearest length reached), plus what the measured groups' time leaves out
    of the wall time (opening the checkpoints)."""
    if not spent_by:
        return float("nan")
    total = 0.0
    for key, group in groups.items():
        near = min(spent_by, key=lambda k: (abs(k[1] - key[1]), k[0] != key[0]))
        seconds, done = spent_by[near]
        total += seconds / done * sum(flops[id(x)] for x in group)
    return total + wall - sum(v[0] for v in spent_by.values())


def _kept_layers(models: dict, precision: str):
    """fp32: each weight set's layers decoded and cast once for all its passes (the fp32 copies fit a GPU)."""
    import contextlib

    from reference_impl.truth.probes import keeping_layers

    return keeping_layers(*(m.truth for m in models.values())) if precision != "fp64" else contextlib.nullcontext()


def _measure(models: dict, groups: dict, flops: dict, probes: int, precision: str, chunk: int, budget_s: float,
             t0: float, device: str) -> tuple[dict, int, int]:
    """The truth of ``groups`` (:func:`_interleaved` order) with ``probes`` probes until ``budget_s`` after
    ``t0``: per group ``[seconds, floor FLOPs done]``, the sequences and tokens done."""
    spent_by: dict[tuple[str, int], list[float]] = {}
    done, tokens, total = 0, 0, sum(len(g) for g in groups.values())
    with _kept_layers(models, precision):
        for key, part in _interleaved(groups, chunk):
            if done and time.perf_counter() - t0 > budget_s:  # at least one chunk, whatever opening took
                break
            t1 = time.perf_counter()
            models[key[0]].teacher_forced_many([(p, c) for _, p, c in part], probes, precision=precision)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            cell = spent_by.setdefault(key, [0.0, 0.0])
            cell[0] += time.perf_counter() - t1
            cell[1] += sum(flops[id(x)] for x in part)
            done += len(part)
            tokens += key[1] * len(part)
            spent = time.perf_counter() - t0
            # progress on stderr: a run stopped from outside still leaves its rate
            print(f"[{spent:.0f} s] {done}/{total} sequences, {tokens} tokens (the last {len(part)} of "
                  f"{key[1]}), {1e3 * spent / tokens:.1f} ms per token so far, projected "
                  f"{_projection(groups, flops, spent_by, spent):.0f} s", file=sys.stderr, flush=True)
    return spent_by, done, tokens


def _measure_whole(models: dict, all_seqs: list, probes: int, precision: str, t0: float, device: str) -> None:
    """The truth of each weight set's sequences in one call, as the workload judge asks it (sequences of one
    length share probed passes; one fp64 sweep gives every length's values): no budget, the whole workload."""
    with _kept_layers(models, precision):
        for ws, model in models.items():
            pairs = [(p, c) for w, p, c in all_seqs if w == ws]
            model.teacher_forced_many(pairs, probes, precision=precision)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            print(f"[{time.perf_counter() - t0:.0f} s] weight set {ws}: {len(pairs)} sequences, "
                  f"{sum(len(p) + len(c) for p, c in pairs)} tokens", file=sys.stderr, flush=True)


def run(path: str, workload_name: str, device: str, budget_s: float, b_path: str | None = None,
        chunk: int = 64, precision: str = "fp64", screen: int | None = None) -> dict:
    from conformance.server.workloads import load
    from reference_impl.truth.golden import ExactModel

    workload = load(workload_name)
    cfg = json.loads((Path(path) / "config.json").read_text())
    seqs = judged_sequences(workload, cfg["vocab_size"])
    all_seqs = [(ws, p, c) for ws in ("a", "b") for p, c in seqs[ws]]
    flops = {id(x): 3 * forward_flops(cfg, len(x[1]) + len(x[2])) for x in all_seqs}  # forward + backward
    rate = gemm_rate(device)
    files = sorted(Path(path).glob("*.safetensors"))
    disk, size = disk_rate(files)
    total_flops = sum(flops.values())
    floor_s = total_flops / rate + size / disk
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    models = {"a": ExactModel(path, device)}
    models["b"] = ExactModel(b_path, device) if b_path else models["a"]  # same shape: the cost is the same
    groups: dict[tuple[str, int], list] = {}  # sequences of one weight set and length share probed passes
    for x in all_seqs:
        groups.setdefault((x[0], len(x[1]) + len(x[2])), []).append(x)
    screen = workload.screen_probes if screen is None else screen
    first = screen or workload.probes  # with a screen, the probes every answer takes (a correct engine's truth)
    if chunk:
        spent_by, done, tokens = _measure(models, groups, flops, first, precision, chunk, budget_s, t0, device)
        done_flops = sum(v[1] for v in spent_by.values())
    else:  # chunk 0: the whole workload, each weight set in one call
        _measure_whole(models, all_seqs, first, precision, t0, device)
        spent_by, done, tokens, done_flops = None, len(all_seqs), sum(len(p) + len(c) for _, p, c in all_seqs), total_flops
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    import resource

    return {"workload": workload.name, "precision": precision, "probes": workload.probes, "sequences": len(all_seqs), "done": done,
            "tokens_done": tokens, "tokens": sum(len(p) + len(c) for _, p, c in all_seqs),
            "gemm_tflops": rate / 1e12, "disk_gb_s": disk / 1e9, "checkpoint_gb": size / 1e9,
            "floor_s": floor_s, "truth_s_done": wall, "floor_s_done": done_flops / rate + size / disk,
            "projected_s": _projection(groups, flops, spent_by, wall) if spent_by is not None else wall,
            "screen": screen, "probes_run": first,
            "lengths": [len(p) + len(c) for _, p, c in all_seqs],
            "peak_gpu_gib": torch.cuda.max_memory_reserved() / 2**30 if device.startswith("cuda") else 0.0,
            "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def table(r: dict) -> str:
    return "\n".join([
        "| workload | precision | probes | sequences (done) | tokens (done) | fp64 GEMM TFLOP/s | disk GB/s | floor s | "
        "truth s (done) | floor s (done) | projected s | projected / floor | peak GPU GiB | peak host GiB |",
        "|" + " --- |" * 14,
        f"| {r['workload']} | {r['precision']} | {_probes(r)} | {r['sequences']} ({r['done']}) | {r['tokens']} ({r['tokens_done']}) | "
        f"{r['gemm_tflops']:.1f} | {r['disk_gb_s']:.2f} | {r['floor_s']:.1f} | {r['truth_s_done']:.1f} | "
        f"{r['floor_s_done']:.1f} | {r['projected_s']:.0f} | {r['projected_s'] / r['floor_s']:.1f} | "
        f"{r['peak_gpu_gib']:.1f} | {r['peak_host_gib']:.1f} |"])


def layer_bytes(path: str) -> tuple[int, dict[int, int]]:
    """The checkpoint's bytes outside its decoder layers and per layer index (from the safetensors headers)."""
    import re

    from reference_impl.truth.weights import CheckpointFiles

    other, per = 0, {}
    for name, t in CheckpointFiles(path).lazy().items():
        size = t.numel() * t.dtype.itemsize
        m = re.search(r"layers\.(\d+)\.", name)
        if m:
            per[int(m.group(1))] = per.get(int(m.group(1)), 0) + size
        else:
            other += size
    return other, per


def by_depth(rows: dict[int, dict], cfg: dict, full_layers: int, path: str) -> dict:
    """The whole model's figures from the workload's truth at two truncated depths ``rows[d1]``, ``rows[d2]`` of
    one checkpoint: per layer ``(P2 - P1) / (d2 - d1)`` of the projected times, the whole model ``P1 + (L - d1)``
    per layer; its floor at full depth (the layers past the written ones read like the last one written)."""
    (d1, r1), (d2, r2) = sorted(rows.items())
    per_layer = (r2["projected_s"] - r1["projected_s"]) / (d2 - d1)
    whole = r1["projected_s"] + (full_layers - d1) * per_layer
    other, per = layer_bytes(path)
    last = per[max(per)]
    size = other + sum(per.get(i, last) for i in range(full_layers))
    full_cfg = {**cfg, "num_hidden_layers": full_layers}
    flops = sum(3 * forward_flops(full_cfg, n) for n in r1["lengths"])
    floor = flops / (r1["gemm_tflops"] * 1e12) + size / (r1["disk_gb_s"] * 1e9)
    return {"d1": d1, "d2": d2, "layers": full_layers, "per_layer_s": per_layer, "whole_model_s": whole,
            "whole_floor_s": floor, "ratio": whole / floor, "whole_checkpoint_gb": size / 1e9}


def _probes(r: dict) -> str:
    return f"{r['probes_run']} (screen) of {r['probes']}" if r.get("screen") else str(r["probes"])


def precision_change(path: str, workload_name: str, device: str, lengths: tuple[int, ...] = (80, 513),
                     per_length: int = 4, probes: int = 16) -> dict:
    """The fp32 probes' variance estimates against the fp64 ones from the same draws (same seed, same batching)
    on ``per_length`` sequences of each of ``lengths`` tokens, with the tangent GEMMs in BF16 (the default) and
    in TF32: per mode the largest, mean and mean signed ``V32 / V64 - 1`` over every row's logprob and gap
    estimate, and the largest difference of the values (fp64 in both)."""
    import reference_impl.truth.probe_pass as pass_
    import reference_impl.truth.probes as probes_mod
    from conformance.server.workloads import load
    from reference_impl.truth.golden import ExactModel

    workload = load(workload_name)
    model = ExactModel(path, device)
    rows = probes_mod.rows_budget(model.cfg, torch.float64)  # the fp64 batching for both
    batches = [workload.prompts(model.cfg.vocab_size, n, per_length, "precision") for n in lengths]
    ref = [probes_mod.probe_sequences(model.truth, q, [x[1:] + [x[0]] for x in q], probes, seed=5, max_rows=rows)
           for q in batches]
    out = {"lengths": list(lengths), "per_length": per_length, "probes": probes}
    default = pass_.TANGENT_GEMM
    try:
        for name, gemm in (("bf16", torch.bfloat16), ("tf32", None)):
            pass_.TANGENT_GEMM = gemm
            ratios, value_diff = [], 0.0
            for q, r64 in zip(batches, ref):
                r32 = probes_mod.probe_sequences(model.truth, q, [x[1:] + [x[0]] for x in q], probes, seed=5,
                                                 max_rows=rows, precision="fp32")
                for a, b in zip(r64, r32):
                    value_diff = max(value_diff, float((a.logprob - b.logprob).abs().max()))
                    ratios.append(b.logprob_var / a.logprob_var - 1)
                    keep = a.gap_var > 0
                    ratios.append(b.gap_var[keep] / a.gap_var[keep] - 1)
            r = torch.cat(ratios)
            out[name] = {"rows": int(r.numel()), "max_abs": float(r.abs().max()), "mean_abs": float(r.abs().mean()),
                         "mean": float(r.mean()), "value_diff": value_diff}
    finally:
        pass_.TANGENT_GEMM = default
    return out
