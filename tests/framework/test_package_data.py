"""The suite's data (golden snapshots, rule matrices and profiles, the checkpoint builder) is found through the
installed data package ``nvfp4_conformance_fixtures`` (the repository's fixtures/, setup.py; never a top-level
``fixtures``, an unrelated PyPI distribution's name) (conformance/_framework/data.py), not through paths relative to a repository: a
wheel built from this tree and installed elsewhere reads every file from inside the install, and ships no built
checkpoints. Imports conformance._framework: it tests the framework itself."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conformance._framework import data

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"


def shipped_files() -> list[str]:
    """The data files the suite reads, relative to fixtures/: what the wheel must hold."""
    files = [p for d in ("snapshots", "config_rules") for p in (FIXTURES / d).rglob("*.json")]
    return sorted(str(p.relative_to(FIXTURES)) for p in files) + ["__init__.py", "make_checkpoints.py"]


# ----------------------------------------------------------------------------------------- the helper (unit)
def test_data_root_is_the_imported_fixtures_package():
    assert data.data_root() == FIXTURES
    assert data.data_path("config_rules", "dense.json").is_file()
    for rel in data.REQUIRED:
        assert data.data_path(rel).exists(), f"{rel} missing from {data.data_root()}"
    assert Path(data.checkpoint_builder().__file__) == FIXTURES / "make_checkpoints.py"


def test_readers_use_the_helper(monkeypatch, tmp_path):
    from conformance._framework import snapshots
    from conformance.rules import matrix, oracle

    assert snapshots.DEFAULT_SNAPSHOT_ROOT == data.data_path("snapshots")
    assert matrix.FIXTURES == data.data_path("config_rules")
    assert oracle.ORACLE_FILE == data.data_path("config_rules", "upstream_expectations.json")
    monkeypatch.delenv(snapshots.SNAPSHOT_DIR_ENV, raising=False)
    assert snapshots.snapshot_root() == data.data_path("snapshots")
    monkeypatch.setenv(snapshots.SNAPSHOT_DIR_ENV, str(tmp_path))  # the override still wins
    assert snapshots.snapshot_root() == tmp_path


def test_missing_or_foreign_fixtures_package_is_reported(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, data.DATA_PACKAGE, None)  # import fails
    monkeypatch.setitem(sys.modules, data.CLONE_PACKAGE, None)
    with pytest.raises(data.DataNotFound, match="cannot be imported"):
        data.data_root()
    # not installed, and the `fixtures` found is PyPI's unrelated distribution
    monkeypatch.setitem(sys.modules, data.CLONE_PACKAGE, types.ModuleType("fixtures"))
    with pytest.raises(data.DataNotFound, match="shadows it"):
        data.data_root()


def test_checkpoints_go_to_the_user_cache_outside_a_source_tree(monkeypatch, tmp_path):
    builder = data.checkpoint_builder()
    assert builder.default_out() == FIXTURES / "checkpoints"  # this clone
    installed = tmp_path / "site-packages" / "fixtures"
    installed.mkdir(parents=True)
    monkeypatch.setattr(builder, "__file__", str(installed / "make_checkpoints.py"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert builder.default_out() == tmp_path / "cache" / builder.CACHE_DIR_NAME / "checkpoints"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert builder.default_out() == tmp_path / "home" / ".cache" / builder.CACHE_DIR_NAME / "checkpoints"


# ----------------------------------------------------------------------------------------- a built wheel (integration)
_PROBE = r"""
import json, sys
from pathlib import Path
import conformance, nvfp4_conformance_fixtures as fixtures
from conformance._framework import data, snapshots
from conformance.rules import matrix
builder = data.checkpoint_builder()
print(json.dumps({
    "conformance": conformance.__file__, "fixtures": fixtures.__file__, "root": str(data.data_root()),
    "files": sorted(str(p.relative_to(data.data_root())) for p in data.data_root().rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts),
    "snapshots": str(snapshots.snapshot_root()), "rules": str(matrix.FIXTURES), "profiles": matrix.profile_names(),
    "builder": builder.__file__, "default_out": str(builder.DEFAULT_OUT),
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """This tree built into a wheel (offline, from a copy holding a planted checkpoint build) and installed with
    ``pip install --target``; returns the install directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "checkpoints")
    for name in ("conformance", "reference_impl", "fixtures"):
        shutil.copytree(REPO / name, src / name, ignore=junk)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    planted = src / "fixtures" / "checkpoints" / "dense-nvfp4-a"  # a build the wheel must leave out
    planted.mkdir(parents=True)
    (planted / "config.json").write_text("{}")
    (planted.parent / "BUILD_STAMP").write_text("x\n")
    wheels, target = tmp / "wheels", tmp / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-index", "--no-build-isolation", str(src), "-w",
                            str(wheels)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"building the wheel failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
    (wheel,) = wheels.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    leaked = [n for n in names if n.startswith(f"{data.DATA_PACKAGE}/checkpoints")]
    assert not leaked, f"the wheel ships built checkpoints (fixtures/checkpoints/ must stay out): {leaked}"
    clash = [n for n in names if n.startswith("fixtures/")]
    assert not clash, f"the wheel ships a top-level `fixtures` package (PyPI's `fixtures` would be overwritten): {clash[:3]}"
    missing = [f for f in shipped_files() if f"{data.DATA_PACKAGE}/{f}" not in names]
    assert not missing, f"the wheel lacks data files the suite reads (setup.py package_data): {missing}"
    inst = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, f"installing the wheel failed:\n{inst.stdout[-3000:]}\n{inst.stderr[-3000:]}"
    return target


def _run_installed(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVFP4_")}
    env["PYTHONPATH"] = str(target)  # the install first; the repository is on no path
    env["XDG_CACHE_HOME"] = str(cwd / "cache")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_installed_wheel_finds_every_data_file_inside_the_install(installed, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run_installed(installed, empty, "-c", _PROBE)
    assert r.returncode == 0, f"the installed suite cannot locate its data:\n{r.stderr[-3000:]}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("conformance", "fixtures", "root", "snapshots", "rules", "builder"):
        assert Path(got[key]).is_relative_to(installed), (
            f"{key} resolves to {got[key]}, outside the install {installed}: read relative to a repository")
    assert Path(got["root"]) == installed / data.DATA_PACKAGE
    missing = sorted(set(shipped_files()) - set(got["files"]))
    assert not missing, f"the installed data helper does not find {missing} in {got['root']}"
    for rel in shipped_files():
        assert (installed / data.DATA_PACKAGE / rel).read_bytes() == (FIXTURES / rel).read_bytes(), f"{rel} differs"
    assert got["profiles"] == sorted(p.stem for p in (FIXTURES / "config_rules" / "profiles").glob("*.json"))
    assert not (installed / data.DATA_PACKAGE / "checkpoints").exists()
    assert not (installed / "fixtures").exists()
    # built on first use into the user's cache, never into the install
    assert Path(got["default_out"]) == empty / "cache" / "nvfp4-w4a16-conformance" / "checkpoints"


def _counts(out: str) -> dict[str, int]:
    last = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)][-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?)", last)}


@pytest.mark.integration
def test_installed_suite_runs_its_data_tests_from_an_empty_directory(installed, tmp_path):
    """The golden-data and rule-matrix tests of the installed suite, run from a directory holding nothing, give
    the clone's outcome counts (a skip or failure for want of data would show as a difference)."""
    modules = ["conformance.dense.test_dense_golden", "conformance.rules.test_config_rules_upstream",
               "conformance.format.test_format"]
    select = ["-p", "no:cacheprovider", "-p", "no:randomly", "-q", "-k", "golden or canonical or upstream"]
    r = _run_installed(installed, tmp_path, "-m", "pytest", "-p", "conformance.plugin", *select, "--pyargs", *modules)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVFP4_")}
    clone = subprocess.run([sys.executable, "-m", "pytest", *select,
                            *(m.replace(".", "/") + ".py" for m in modules)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert clone.returncode == 0, clone.stdout[-3000:]
    got, want = _counts(r.stdout), _counts(clone.stdout)
    assert got.get("passed", 0) > 0 and got == want, (
        f"installed suite from an empty directory {got} != the clone's {want}:\n{tail}")
