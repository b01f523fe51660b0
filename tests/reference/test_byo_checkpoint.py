"""Bring your own checkpoint: the scenario suite runs on a checkpoint this repository's fixture builder did
not write (tests/reference/byo_exporter.py: an independent NVFP4 exporter in ModelOpt's HF layout, sharded, no
tokenizer), with the checkpoint's own tokenizer and with ``--tokenizer``, and leaves the checkpoint
directory byte for byte as it was (it is also made read-only for the run). Missing or unfitting
tokenizers are clear errors at start."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conformance.server.scenarios import SCENARIOS
from tests.reference import byo_exporter

pytestmark = pytest.mark.integration  # starts servers or whole pytest runs (ci/time_tests.py times them apart)

REPO = Path(__file__).resolve().parents[2]
# every scenario at TP1 (tp_agreement needs TP > 1): counted from the list, which grows
SCENARIOS_RUN = sum(not s.needs_tp_baseline for s in SCENARIOS)
# the damage classes (conformance/server/corruptions.py) test the loader, whose checks are the same for every
# architecture: one nested run offers them all (a sharded ModelOpt export, tests/reference/test_modelopt_checkpoint.py), the
# others leave them out (five scenarios x nine exports of CI time)
DAMAGE_SCENARIOS = tuple(s.id for s in SCENARIOS if s.id.startswith("failed_reload_")
                         and s.id not in ("failed_reload_missing_path", "failed_reload_corrupt_checkpoint"))


def _state(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: kind, size, mtime and sha256 of the contents."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
        out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


def _read_only(root: Path, on: bool) -> None:
    for p in [root, *root.rglob("*")]:
        mode = p.stat().st_mode
        write = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
        p.chmod(mode & ~write if on else mode | stat.S_IWUSR)


def _run_suite(tmp: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NVFP4_SERVER_WORK_DIR", "PYTEST_XDIST", "NVFP4_CONFORMANCE_SERVER_API"))}
    env["TMPDIR"] = str(tmp)  # the suite's own temporary files go here: checked for leftovers
    cmd = [sys.executable, "-m", "pytest", "conformance/server/test_server_scenarios.py", "-p", "no:cacheprovider", "-q",
           "-rs", "--server-configs", "cpu-tp1", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def assert_suite_passes_and_leaves_checkpoint_untouched(tmp: Path, ckpt: Path, extra: list[str],
                                                        damage_classes: bool = False) -> None:
    """Every TP1 scenario passes (none skipped) on ``ckpt`` (the damage classes only with ``damage_classes``),
    made read-only for the run, and its files' contents and modification times are what they were; the suite
    leaves no work directory behind."""
    before = _state(ckpt)
    _read_only(ckpt, True)
    select = [] if damage_classes else ["-k", "not (" + " or ".join(DAMAGE_SCENARIOS) + ")"]
    try:
        r = _run_suite(tmp, "--server-checkpoint", str(ckpt), *extra, *select)
    finally:
        _read_only(ckpt, False)
    report = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0, report
    expected = SCENARIOS_RUN - (0 if damage_classes else len(DAMAGE_SCENARIOS))
    assert f"{expected} passed" in r.stdout and "skipped" not in r.stdout, report
    _read_only(ckpt, True)  # restore the exact permissions before comparing metadata
    _read_only(ckpt, False)
    after = _state(ckpt)
    assert {k: v[3] for k, v in after.items()} == {k: v[3] for k, v in before.items()}, "contents changed"
    assert {k: v[2] for k, v in after.items()} == {k: v[2] for k, v in before.items()}, "modification times changed"
    assert not list(tmp.glob("nvfp4-server-suite-*")), "the suite left its work directory behind"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("byo")
    plain = byo_exporter.export(base / "llama-nvfp4", "llama", "NVFP4", tokenizer_dir=base / "tokenizer")
    with_tok = base / "llama-nvfp4-with-tokenizer"
    shutil.copytree(plain, with_tok)
    shutil.copyfile(base / "tokenizer" / "tokenizer.json", with_tok / "tokenizer.json")
    return {"plain": plain, "with_tokenizer": with_tok, "tokenizer": base / "tokenizer"}


@pytest.mark.parametrize("variant", ["own-tokenizer", "tokenizer-option"])
def test_scenarios_on_an_independent_checkpoint(exported, tmp_path, variant):
    ckpt = exported["with_tokenizer" if variant == "own-tokenizer" else "plain"]
    extra = [] if variant == "own-tokenizer" else ["--tokenizer", str(exported["tokenizer"])]
    assert_suite_passes_and_leaves_checkpoint_untouched(tmp_path, ckpt, extra)


def test_missing_tokenizer_is_a_clear_error_at_start(exported, tmp_path):
    r = _run_suite(tmp_path, "--server-checkpoint", str(exported["plain"]), "--collect-only", timeout=300)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "has no tokenizer.json" in r.stderr and "--tokenizer" in r.stderr, r.stderr


def test_tokenizer_larger_than_the_vocabulary_is_a_clear_error_at_start(exported, tmp_path):
    big = byo_exporter.write_tokenizer(tmp_path / "big", byo_exporter.VOCAB + 5)
    r = _run_suite(tmp_path, "--server-checkpoint", str(exported["plain"]), "--tokenizer", str(big),
                   "--collect-only", timeout=300)
    assert r.returncode == 4 and "does not fit this checkpoint" in r.stderr, r.stdout + r.stderr


def test_ids_beyond_a_small_tokenizer_are_a_clear_error(exported, tmp_path):
    """A tokenizer smaller than the vocabulary is allowed (padded vocabularies) unless the model generates
    ids it cannot decode: then the suite says so instead of comparing texts with silently dropped tokens."""
    from conformance.server.models import ModelCatalog, ModelError

    small = byo_exporter.write_tokenizer(tmp_path / "small", 40)
    catalog = ModelCatalog([], None, [str(exported["plain"])], str(small))
    os.environ.pop("NVFP4_SERVER_WORK_DIR", None)
    model = catalog.served(catalog.names()[0])
    try:
        with pytest.raises(ModelError, match=r"generates token ids \[.*\].*cannot decode"):
            catalog.truth(model, "a")
    finally:
        from conformance.server.models import remove_work_dir

        remove_work_dir()


def test_reference_server_never_drops_unknown_ids(tmp_path):
    from tokenizers import Tokenizer

    from reference_impl.server.outputs import Detokenizer

    detok = Detokenizer(Tokenizer.from_file(str(byo_exporter.write_tokenizer(tmp_path, 10))), None)
    assert detok.decode([4, 5]) == "the of"
    assert detok.decode([4, 12, 5]) == "the<|token_id=12|>of"
    assert detok.token_text(12) == "<|token_id=12|>"


# ----------------------------------------------------------------------------------------- the derived checkpoints
@pytest.mark.parametrize("arch,algo", [("llama", "NVFP4"), ("qwen3_moe", "W4A16_NVFP4")])
def test_derived_weight_sets(tmp_path, arch, algo):
    """b differs from a in every tensor and still loads; corrupt is b minus exactly one tensor of the last
    layer, rejected for that tensor; the exporter's codes are ModelOpt's recipe (the reference agrees)."""
    from conformance.server.derive import derive_corrupt, derive_different_weights, tensor_names, verify_corrupt
    from reference_impl.model.checkpoint import load_checkpoint
    from reference_impl.model import validate_checkpoint
    from reference_impl.format.nvfp4 import quantize_modelopt

    src = byo_exporter.export(tmp_path / "src", arch, algo)
    before = _state(src)
    unchanged = derive_different_weights(src, tmp_path / "b")
    assert unchanged == []
    validate_checkpoint(load_checkpoint(tmp_path / "b"))
    tensor = derive_corrupt(tmp_path / "b", tmp_path / "corrupt")
    assert tensor.startswith("model.layers.1.") and tensor.endswith("down_proj.weight_scale")
    verify_corrupt(str(tmp_path / "b"), str(tmp_path / "corrupt"), tensor)
    with pytest.raises(AssertionError, match="not .* minus exactly"):
        verify_corrupt(str(tmp_path / "b"), str(tmp_path / "b"), tensor)
    assert tensor not in tensor_names(tmp_path / "corrupt")
    assert _state(src) == before
    # the exporter (numpy + ml_dtypes) and the reference's quantizer implement the same recipe independently
    w = np.random.default_rng(3).standard_normal((64, 128)).astype(np.float32)
    ours = byo_exporter.quantize_nvfp4(w)
    ref = quantize_modelopt(torch.from_numpy(w), torch.tensor(float(ours["weight_scale_2"])))
    assert np.array_equal(ref.packed.numpy(), ours["weight"])
    assert np.array_equal(ref.block_scale.view(torch.uint8).numpy(), ours["weight_scale"].view(np.uint8))


def test_server_checkpoints_dir_is_only_read(tmp_path):
    """--server-checkpoints DIR: a directory without an up-to-date fixture build is an error; nothing is
    written there (no fixtures, no .gitignore, no lock file)."""
    from conformance.server.models import ModelError, ensure_fixture_root

    (tmp_path / "mine.txt").write_text("user data\n")
    with pytest.raises(ModelError, match="never writes there"):
        ensure_fixture_root(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
