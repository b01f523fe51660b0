"""Every third-party package the suite's own code imports (reference_impl/, conformance/, fixtures/) is a main
dependency in pyproject.toml, so ``pip install -e .`` alone runs the README's first command; or it is one of the
optional packages below, each imported only where it is needed (never at a module's top level), whose absence is
a skip with the reason. The failure this guards against: the truth imported transformers, a test-only extra, and
the first README command failed 18 server scenarios in a fresh venv."""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("reference_impl", "conformance", "fixtures")
LOCAL = {"reference_impl", "conformance", "fixtures", "tests", "ci", "benchmarks", "examples", "paths_matrices"}
#: import name -> why it may be missing (each only imported inside the function that needs it)
OPTIONAL = {
    "flashinfer": "the flashinfer backend and the FlashInfer CPU quantizer oracle: skip with the reason",
    "cudnn": "FlashInfer's cudnn GEMM backend precondition (b200 tier)",
    "cutlass": "FlashInfer's CuTe DSL kernels' can_implement (b200 tier)",
    "sglang": "--engine sglang (SGLangUnavailable names the install command)",
    "vllm": "--engine vllm (VLLMUnavailable names the install command)",
    "modelopt": "fixtures/config_rules/generate.py, a maintainer script",
    "humming": "vLLM's Humming MoE experts question of the vllm rules (skip with the reason)",
    "matplotlib": "the workload coverage map's PNG (extra 'reports'; JSON and Markdown without it)",
    "triton": "the CUDA grouped-GEMM path of reference_impl/moe/grouped.py and the truth's attention kernels "
              "(reference_impl/truth/attention_kernel.py; torch's CUDA builds ship it)",
    "tomli": "expectation files on Python 3.10 (a conditional main dependency)",
}


def _imports() -> dict[str, list[tuple[str, bool]]]:
    """top-level import name -> [(file, at module level?)] over the suite's own packages."""
    out: dict[str, list[tuple[str, bool]]] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            top = set(map(id, tree.body))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    root = name.split(".")[0]
                    if root not in sys.stdlib_module_names and root not in LOCAL:
                        out.setdefault(root, []).append((str(path.relative_to(REPO)), id(node) in top))
    return out


def _main_dependencies() -> set[str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].strip().lower().replace("_", "-") for d in deps}


def test_every_imported_package_is_declared_or_optional() -> None:
    declared = _main_dependencies()
    dists = importlib.metadata.packages_distributions()
    undeclared = {}
    for name, where in _imports().items():
        if name in OPTIONAL:
            continue
        owners = {d.lower().replace("_", "-") for d in dists.get(name, [name])}
        if not owners & declared:
            undeclared[name] = sorted({f for f, _ in where})[:3]
    assert not undeclared, f"imported but not a main dependency in pyproject.toml: {undeclared}"


def test_optional_packages_are_imported_only_where_needed() -> None:
    at_top = {name: sorted(f for f, top in where if top) for name, where in _imports().items() if name in OPTIONAL}
    # a module that is itself optional (it exists to call the package) may import it at its top
    allowed = {"fixtures/config_rules/generate.py", "reference_impl/moe/_triton_grouped_gemm.py",
               "reference_impl/truth/_attention_triton.py", "reference_impl/truth/_store_triton.py"}
    offending = {n: [f for f in files if f not in allowed] for n, files in at_top.items()}
    assert not any(offending.values()), f"optional packages imported at module level: {offending}"


def test_the_check_catches_an_undeclared_import(monkeypatch) -> None:
    """Its mutant: with transformers taken out of the main dependencies, the check names it."""
    declared = _main_dependencies()
    assert "transformers" in declared
    monkeypatch.setattr(sys.modules[__name__], "_main_dependencies", lambda: declared - {"transformers"})
    try:
        test_every_imported_package_is_declared_or_optional()
    except AssertionError as exc:
        assert "transformers" in str(exc) and "reference_impl/truth/hf.py" in str(exc), exc
    else:
        raise AssertionError("removing transformers from the main dependencies went unnoticed")
