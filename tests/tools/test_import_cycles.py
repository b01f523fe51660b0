"""No import cycle between the repository's modules (ci/import_cycles.py, every import statement counted,
deferred ones too), and the checker finds the cycles it is for: planted in a scratch package, at module level,
inside a function, through ``from package import module`` and through a relative import."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "ci"))
import import_cycles  # noqa: E402


def test_the_repository_has_no_import_cycle() -> None:
    found = import_cycles.cycles(import_cycles.graph(REPO, (*import_cycles.DEFAULT_PACKAGES, "tests")))
    assert not found, "\n".join(" -> ".join(loop) for loop in found)


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("files,loop", [
    ({"__init__.py": "", "a.py": "import pkg.b\n", "b.py": "import pkg.a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
    ({"__init__.py": "", "a.py": "from pkg import b\n", "b.py": "def f():\n    from pkg.a import x\n"},
     ["pkg.a", "pkg.b", "pkg.a"]),
    ({"__init__.py": "", "a.py": "from .b import y\n", "b.py": "from . import c\n", "c.py": "from .a import z\n"},
     ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]),
    ({"__init__.py": "from pkg.a import f\n", "a.py": "from pkg import g\n"}, ["pkg", "pkg.a", "pkg"]),
], ids=["module-level", "deferred-in-function", "relative-three", "package-init"])
def test_a_planted_cycle_is_found(tmp_path, files, loop) -> None:
    _package(tmp_path, files)
    assert import_cycles.cycles(import_cycles.graph(tmp_path, ("pkg",))) == [loop]


def test_imports_outside_the_packages_and_of_submodules_by_init_are_not_cycles(tmp_path) -> None:
    _package(tmp_path, {"__init__.py": "from pkg.a import f\nimport torch\n", "a.py": "import os\nimport torch.nn\n",
                        "b.py": "from pkg.a import f\n"})
    assert import_cycles.cycles(import_cycles.graph(tmp_path, ("pkg",))) == []


def test_the_vendor_interfaces_depend_only_on_themselves_and_reference_impl() -> None:
    """What a vendor imports to implement an interface pulls in no suite internals (framework, areas, adapters)."""
    g = import_cycles.graph(REPO, ("conformance", "reference_impl"))
    outside = {m: sorted(d for d in deps if not d.startswith(("conformance.interfaces", "reference_impl")))
               for m, deps in g.items() if m.startswith("conformance.interfaces")}
    assert not any(outside.values()), {m: d for m, d in outside.items() if d}
