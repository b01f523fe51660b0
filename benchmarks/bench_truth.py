"""Time and memory of the golden truth (``ExactModel(path, device).golden(4 prompts, 8 steps)``, variance proxies
included, as ``--server-checkpoint`` computes it) per model shape, with the per-layer cost.

    python benchmarks/bench_truth.py --work /scratch/truth-models [--device cuda] [--shapes fixtures,llama-3.1-8b,...]
    python benchmarks/bench_truth.py --workload standard --checkpoint DIR [--precision fp32]  # a workload's truth
    python benchmarks/bench_truth.py --workload standard --shapes llama-3.1-70b,deepseek-v3 --work DIR  # by depth

Each shape's random-weight checkpoint is written by benchmarks/make_truth_models.py (real config, truncated
depth where the model is large) and evicted from the page cache before every measurement, so each run reads
its weights from the disk. Each measurement runs in a fresh process (peak host memory = its max RSS; peak GPU
memory = PyTorch's peak reserved). Two depths of one checkpoint (a config truncated further, the same files)
give the per-layer cost ``(t2 - t1) / (d2 - d1)``, measured in the same run, and the whole-model estimate
``t1 + (layers - d1) * per_layer``. Columns:

* ``golden s``: opening the checkpoint (validation), the reference's own greedy path, then the analysis (what a
  session computes per checkpoint), in a cold process (CUDA start-up included);
* ``forced s``: the same golden outputs by teacher forcing a given continuation (the engine's tokens when they
  are the reference's greedy path: one forward instead of one per step), in the same process after it;
* ``digest s``: the full-content checkpoint digest, hashed on a thread meanwhile (its own wall time).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
PROMPT_LENGTHS = (5, 9, 8, 5)  # the server scenarios' four prompts under a Llama-3 tokenizer: 5 to 9 tokens
STEPS = 8
#: shape -> (depth written, (d1, d2) of the per-layer figure, full depth, the layers the figure stands for)
PLANS = {
    "llama-3.1-8b": (32, (16, 32), 32),
    "llama-3.1-70b": (4, (2, 4), 80),
    "deepseek-v3": (4, (3, 4), 61),  # 3 dense layers, then MoE: d2 - d1 is one MoE layer (58 of them follow)
}

#: ``--tiny``: the same configs at toy dimensions (a check of the benchmark itself, on a CPU)
TINY = {
    "llama-3.1-8b": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, vocab_size=1000),
    "deepseek-v3": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_attention_heads=4,
                        num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                        q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                        vocab_size=1000),
}
TINY["llama-3.1-70b"] = TINY["llama-3.1-8b"]


def measure(path: str, device: str, vocab: int) -> dict:
    """One measurement (run in a fresh process by :func:`child`)."""
    import torch

    from reference_impl.truth.golden import ExactModel

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    cuda = device.startswith("cuda")
    t0 = time.perf_counter()
    model = ExactModel(path, device)
    t_open = time.perf_counter() - t0
    gold = model.golden(prompts, STEPS)
    t_golden = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    peak_gpu = torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0
    t1 = time.perf_counter()
    forced = model.golden(prompts, STEPS, candidates=gold.output_ids.tolist())
    t_forced = time.perf_counter() - t1
    same = bool(torch.equal(forced.output_ids, gold.output_ids)
                and torch.equal(forced.logprobs, gold.logprobs) and torch.equal(forced.logprob_var, gold.logprob_var))
    return {"open_s": t_open, "golden_s": t_golden, "forced_s": t_forced,
            "forced_identical": same, "peak_gpu_gib": peak_gpu,
            "peak_gpu_all_gib": (torch.cuda.max_memory_reserved() / 2**30) if cuda else 0.0,
            "peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "read_gib": model.truth.weights.read_bytes / 2**30,
            "finite": bool(torch.isfinite(gold.logprobs).all() and torch.isfinite(gold.logprob_var).all())}


def child(path: str, device: str) -> dict:
    from benchmarks.make_truth_models import drop_page_cache

    cfg = json.loads((Path(path) / "config.json").read_text())
    drop_page_cache(sorted(Path(path).glob("*.safetensors")))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, __file__, "--child", path, "--device", device, "--vocab", str(cfg["vocab_size"])],
                       cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{path}: measurement failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def digest_time(path: str) -> float:
    from reference_impl.truth.weights import CheckpointFiles

    t = time.perf_counter()
    CheckpointFiles(path).digest()
    return time.perf_counter() - t


def run(shapes: list[str], work: Path, device: str, log, tiny: bool = False) -> list[dict]:
    from benchmarks.make_truth_models import view, write
    from fixtures.make_checkpoints import ensure_checkpoints

    rows = []
    for shape in shapes:
        if shape == "fixtures":
            root = ensure_checkpoints()
            for family in ("dense-nvfp4_awq", "moe-w4a16_nvfp4"):
                path = str(root / f"{family}-a")
                cfg = json.loads((Path(path) / "config.json").read_text())
                m = child(path, device)
                rows.append({"shape": f"fixture {family}", "depth": cfg["num_hidden_layers"],
                             "layers": cfg["num_hidden_layers"], **m})
                log(rows[-1])
            continue
        written, (d1, d2), full = PLANS[shape]
        src = work / f"{shape}-{written}"
        t = time.perf_counter()
        write(src, shape, written, cold=True, overrides=TINY[shape] if tiny else None)
        t_write = time.perf_counter() - t
        size = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 2**30
        m = {}
        for d in (d1, d2):
            path = src if d == written else view(src, work / f"{shape}-{written}-view{d}", d)
            m[d] = child(str(path), device)
        per_layer = (m[d2]["golden_s"] - m[d1]["golden_s"]) / (d2 - d1)
        per_layer_forced = (m[d2]["forced_s"] - m[d1]["forced_s"]) / (d2 - d1)
        per_layer_gpu = (m[d2]["peak_gpu_gib"] - m[d1]["peak_gpu_gib"]) / (d2 - d1)
        rows.append({"shape": shape, "depth": d2, "layers": full, "written_gib": size, "write_s": t_write,
                     **m[d2], "d1": d1, "golden_d1_s": m[d1]["golden_s"], "per_layer_s": per_layer,
                     "per_layer_forced_s": per_layer_forced, "per_layer_gpu_gib": per_layer_gpu,
                     "whole_model_s": m[d1]["golden_s"] + (full - d1) * per_layer,
                     "whole_model_forced_s": m[d1]["forced_s"] + (full - d1) * per_layer_forced,
                     "digest_alone_s": digest_time(str(src))})
        log(rows[-1])
    return rows


def table(rows: list[dict]) -> str:
    head = ("| shape | depth run (of) | golden s | forced s | forced / golden | peak GPU GiB | peak host GiB | "
            "read GiB | per layer s | whole model s (est.) | digest alone s |")
    out = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    for r in rows:
        pl = f"{r['per_layer_s']:.2f} (d{r['d1']}->{r['depth']})" if "per_layer_s" in r else ""
        whole = f"{r['whole_model_s']:.0f} (forced {r['whole_model_forced_s']:.0f})" if "whole_model_s" in r else ""
        out.append(f"| {r['shape']} | {r['depth']} ({r['layers']}) | {r['golden_s']:.1f} | {r['forced_s']:.1f} | "
                   f"{r['forced_s'] / r['golden_s']:.2f} | {r['peak_gpu_gib']:.1f} | {r['peak_host_gib']:.1f} | "
                   f"{r['read_gib']:.1f} | {pl} | {whole} | {r.get('digest_alone_s', float('nan')):.1f} |")
    return "\n".join(out)


def run_workload(a: argparse.Namespace, device: str) -> None:
    """``--workload``: the truth of a workload's judged sequences against its floor (benchmarks/truth_workload.py),
    after the fp32 estimates' change against fp64 with ``--compare-precision``."""
    from benchmarks import truth_workload
    from fixtures.make_checkpoints import ensure_checkpoints

    path = a.checkpoint or str(ensure_checkpoints() / "dense-nvfp4_awq-a")
    if a.max_rows:
        import reference_impl.truth.probes as probes

        probes.MAX_ROWS = a.max_rows
    if a.compare_precision:
        change = truth_workload.precision_change(path, a.workload, device)
        print(json.dumps(change), flush=True)
        for mode in ("bf16", "tf32"):
            c = change[mode]
            print(f"fp32 probes, tangent GEMMs in {mode}, against fp64 from the same draws ({c['rows']} rows): "
                  f"|V32/V64 - 1| max {c['max_abs']:.2e}, mean {c['mean_abs']:.2e}, signed mean {c['mean']:+.2e}; "
                  f"values differ by at most {c['value_diff']:.1e}", flush=True)
    shapes = [s for s in (a.shapes or "").split(",") if s in PLANS]
    if shapes:  # truncated depths of a real shape: the truth at two depths, the whole model extrapolated
        from benchmarks.make_truth_models import view, write

        for shape in shapes:
            written, depths, full = PLANS[shape]
            src = write(a.work / f"{shape}-{written}", shape, written, cold=True,
                        overrides=TINY[shape] if a.tiny else None)
            rows = {}
            for d in depths:
                path = str(src if d == written else view(src, a.work / f"{shape}-{written}-view{d}", d))
                rows[d] = truth_workload.run(path, a.workload, device, a.budget_s, chunk=a.chunk,
                                             precision=a.precision, screen=a.screen)
                print(json.dumps({k: v for k, v in rows[d].items() if k != "lengths"}), flush=True)
                print(truth_workload.table(rows[d]), flush=True)
            cfg = json.loads((src / "config.json").read_text())
            whole = truth_workload.by_depth(rows, cfg, full, str(src))
            print(json.dumps({"shape": shape, **whole}), flush=True)
            print(f"{shape}: per layer {whole['per_layer_s']:.1f} s (d{whole['d1']}->d{whole['d2']}), whole model "
                  f"({full} layers) {whole['whole_model_s']:.0f} s projected against its floor "
                  f"{whole['whole_floor_s']:.0f} s: {whole['ratio']:.1f}x", flush=True)
        return
    row = truth_workload.run(path, a.workload, device, a.budget_s, chunk=a.chunk, precision=a.precision,
                             screen=a.screen)
    print(json.dumps({k: v for k, v in row.items() if k != "lengths"}))
    print(f"\ntruth device {device}; {path}")
    print(truth_workload.table(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/nvfp4-truth-models"), help="where checkpoints are written")
    ap.add_argument("--device", default=None, help="truth device (default: cuda if available, else cpu)")
    ap.add_argument("--shapes", default=None,
                    help="shapes to write and measure (default: fixtures," + ",".join(PLANS) + "); with --workload: "
                         "the real shapes at two truncated depths, the whole model extrapolated")
    ap.add_argument("--tiny", action="store_true", help="toy dimensions (checks the benchmark itself)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here (appended as measured)")
    ap.add_argument("--workload", default=None,
                    help="instead: the truth of a workload's judged sequences (quick, standard or a TOML file) on "
                         "--checkpoint, against its floor measured in the same run (benchmarks/truth_workload.py)")
    ap.add_argument("--checkpoint", default=None, help="--workload: the checkpoint (default: the fixture dense-nvfp4_awq-a)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="--workload: truth time spent before projecting")
    ap.add_argument("--chunk", type=int, default=64,
                    help="--workload: sequences per call (budget checked between); 0: each weight set's sequences in "
                         "one call, as the workload judge asks (no budget: the whole workload)")
    ap.add_argument("--max-rows", type=int, default=None,
                    help="--workload: rows (sequences x probes x tokens) of one probed pass (memory; default: "
                         "reference_impl/truth/probes.py MAX_ROWS)")
    ap.add_argument("--precision", default="fp64", choices=("fp64", "fp32"),
                    help="--workload: the probed passes' arithmetic (reference_impl/truth/probes.py PRECISIONS)")
    ap.add_argument("--screen", type=int, default=None,
                    help="--workload: the screen's probes per sequence (default: the workload's screen_probes; 0: "
                         "every sequence takes all its probes)")
    ap.add_argument("--compare-precision", action="store_true",
                    help="--workload: first measure the fp32 estimates' change against fp64 from the same draws")
    ap.add_argument("--trace", action="store_true",
                    help="--workload: each probed pass and the fp64 values' sweep, timed, on stderr (a device sync "
                         "each)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--keep-share", type=float, default=None,
                    help="the share of the truth device's memory the kept fp32 layers may take (default: "
                         "reference_impl/truth/probe_pass.py KEEP_SHARE)")
    a = ap.parse_args()
    if a.keep_share is not None:
        from reference_impl.truth import probe_pass

        probe_pass.KEEP_SHARE = a.keep_share
    from reference_impl.truth.engine import default_device

    device = a.device or default_device()
    if a.child:
        print(json.dumps(measure(a.child, device, a.vocab)))
        return
    if a.workload:
        if a.trace:
            logging.basicConfig(stream=sys.stderr, format="[%(relativeCreated)8.0f ms] %(message)s")
            logging.getLogger("reference_impl.truth").setLevel(logging.INFO)
        run_workload(a, device)
        return

    def log(row):
        print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    rows = run([s for s in (a.shapes or "fixtures," + ",".join(PLANS)).split(",") if s], a.work, device, log, a.tiny)
    print(f"\ntruth device {device}; {len(PROMPT_LENGTHS)} prompts x {STEPS} greedy steps, variance proxies")
    print(table(rows))


if __name__ == "__main__":
    main()
