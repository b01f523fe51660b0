"""Where the suite's shipped data is: the repository's fixtures/ directory, which ``pip install .`` installs with its
data files as the package ``nvfp4_conformance_fixtures`` (setup.py; a clone run uninstalled imports it as
``fixtures``), found by import through :mod:`importlib.resources`. A clone, an
editable install and a non-editable one run from any directory thus read the same files. Every reader of the golden
snapshots, the rule matrices and profiles and the checkpoint builder locates them here.

    data_path("snapshots")                   # the golden data (NVFP4_SNAPSHOT_DIR still overrides it)
    data_path("config_rules", "profiles")    # the rules profiles
    checkpoint_builder()                     # nvfp4_conformance_fixtures.make_checkpoints
"""
from __future__ import annotations

import importlib
import importlib.resources
from pathlib import Path
from types import ModuleType

#: the installed name (setup.py maps the repository's fixtures/ to it), then the clone's own directory name
DATA_PACKAGE = "nvfp4_conformance_fixtures"
CLONE_PACKAGE = "fixtures"
#: the files the suite reads, relative to :func:`data_root` (tests/framework/test_package_data.py checks an installed wheel)
REQUIRED = ("snapshots", "config_rules", "config_rules/profiles", "config_rules/upstream_expectations.json",
            "make_checkpoints.py")
_MARKER = "NVFP4_CONFORMANCE_DATA"


class DataNotFound(RuntimeError):
    """The suite's data package cannot be imported, is another distribution's, or is not on a file system."""


def _package() -> ModuleType:
    try:
        package = importlib.import_module(DATA_PACKAGE)
    except ImportError as installed:
        try:  # a clone run from its root without installing: its fixtures/ directory
            package = importlib.import_module(CLONE_PACKAGE)
        except ImportError:
            raise DataNotFound(f"the suite's data package {DATA_PACKAGE!r} cannot be imported ({installed}): install "
                               f"the suite with `pip install .` from its repository (it installs fixtures/ as "
                               f"{DATA_PACKAGE}; an editable install made before that maps none: re-run `pip install "
                               f"-e .`), or run from a clone's root") from installed
    if not getattr(package, _MARKER, None):
        where = getattr(package, "__file__", None) or list(getattr(package, "__path__", []))
        raise DataNotFound(f"the importable package {package.__name__!r} ({where}) is not this suite's data (it lacks "
                           f"{_MARKER}): another distribution shadows it; reinstall the suite "
                           f"(`pip install --force-reinstall --no-deps .`) or use a separate environment")
    return package


def data_root() -> Path:
    """The directory of the ``fixtures`` package: the clone's fixtures/, or the installed copy."""
    root = importlib.resources.files(_package())
    if not isinstance(root, Path):
        raise DataNotFound(f"the suite's data package is not on a file system ({root!r}, e.g. inside a zip): install "
                           f"the suite unpacked (`pip install .`)")
    return root


def data_path(*parts: str) -> Path:
    """A file or folder of the shipped data, e.g. ``data_path("config_rules", "dense.json")``."""
    return data_root().joinpath(*parts)


def checkpoint_builder() -> ModuleType:
    """The data package's ``make_checkpoints`` (builds the fixture checkpoints; imports torch)."""
    return importlib.import_module(f"{_package().__name__}.make_checkpoints")
