"""Packaging beside pyproject.toml for one thing pyproject cannot say: the repository's fixtures/ (golden data, rule
matrices and profiles, the checkpoint builder) installs under its own unique name, ``nvfp4_conformance_fixtures``,
never as a top-level ``fixtures`` (an unrelated, widely used PyPI distribution has that name). The suite finds it
through conformance/_framework/data.py; built checkpoints (fixtures/checkpoints/) are never shipped."""
from setuptools import find_packages, setup

DATA_PACKAGE = "nvfp4_conformance_fixtures"

setup(
    packages=find_packages(include=["conformance", "conformance.*", "reference_impl", "reference_impl.*"])
    + [DATA_PACKAGE],
    package_dir={DATA_PACKAGE: "fixtures"},
    package_data={DATA_PACKAGE: ["snapshots/**/*.tensors.json", "config_rules/**/*.json"]},
    exclude_package_data={DATA_PACKAGE: ["checkpoints/*", "checkpoints/*/*"]},
)
