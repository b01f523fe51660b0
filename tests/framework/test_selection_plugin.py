"""The one selection plugin: the four options resolve once (the command line, else the environment variable read
at resolution, else the default), one error type, ``--server-api`` taking ``module:attr`` like the others, and the
FlashInfer platform reached through the table. Imports conformance._framework: it tests the framework itself."""
from __future__ import annotations

import pytest

from conformance._framework import selection
from conformance._framework.selection_plugin import selected
from conformance.interfaces.flashinfer_platform import FlashInferPlatform
from conformance.interfaces.hardware import b200_emulated, set_b200_emulation
from conformance.interfaces.server_openai import OpenAIDialect
from conformance.server.dialects import dialect_class


class _Config:
    """What :func:`selected` reads of a pytest config: the options given and the stash."""

    def __init__(self, **options):
        self.options = {f"--{k.replace('_', '-')}": v for k, v in options.items()}
        self.stash = pytest.Stash()

    def getoption(self, name, default=None):
        return self.options.get(name, default)


@pytest.fixture(autouse=True)
def _no_selection_env(monkeypatch):
    for opt in selection.OPTIONS.values():
        for var in (opt.env, *opt.aliases):
            monkeypatch.delenv(var, raising=False)


def test_defaults_when_nothing_is_named():
    chosen = selected(_Config())
    assert chosen.backend == selection.DEFAULT_BACKEND
    assert chosen.engine is None and not chosen.engine_named
    assert (chosen.engine_for("rules"), chosen.engine_for("layer_code")) == ("reference", "sglang")
    assert chosen.server_apis == ("sglang",) and chosen.rules_profile is None


def test_environment_is_read_when_resolved_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("NVFP4_CONFORMANCE_SERVER_API", "openai,vllm")  # set after the options were registered
    monkeypatch.setenv("NVFP4_RULES_PROFILE", "vllm-0.32")
    monkeypatch.setenv("NVFP4_CONFORMANCE_ENGINE", "vllm")
    chosen = selected(_Config())
    assert chosen.server_apis == ("openai", "vllm") and chosen.rules_profile == "vllm-0.32"
    assert chosen.engine == "vllm" and not chosen.engine_named  # from the environment: not asked for by name
    cli = selected(_Config(server_api="sglang", engine="sglang", rules_profile="sglang-main"))
    assert (cli.server_apis, cli.engine, cli.engine_named, cli.rules_profile) == (
        ("sglang",), "sglang", True, "sglang-main")


def test_resolved_once_per_session(monkeypatch):
    config = _Config()
    first = selected(config)
    monkeypatch.setenv("NVFP4_CONFORMANCE_SERVER_API", "openai")
    assert selected(config) is first


def test_one_error_type():
    assert selection.BackendLoadError is selection.SelectionError is selection.EngineLoadError
    with pytest.raises(selection.SelectionError, match="unknown backend 'no-such-backend'"):
        selection.load_backends("no-such-backend")
    with pytest.raises(selection.SelectionError, match="cannot import"):
        selection.load_backends("no_such_module_xyz:Backend")


def test_server_api_takes_module_attr_like_the_other_options():
    assert dialect_class("openai") is OpenAIDialect
    assert dialect_class("conformance.interfaces.server_openai:OpenAIDialect") is OpenAIDialect
    with pytest.raises(ValueError, match="not a conformance.interfaces.server.ServerDialect subclass"):
        dialect_class("collections:OrderedDict")
    with pytest.raises(ValueError, match="unknown server API 'nope'"):
        dialect_class("nope")


def test_flashinfer_platform_comes_from_the_table():
    before = b200_emulated()
    set_b200_emulation(True)
    try:
        emulated, installed = selection.flashinfer_platform(), selection.flashinfer_platform(installed=True)
    finally:
        set_b200_emulation(before)
    assert isinstance(emulated, FlashInferPlatform) and emulated.emulated
    assert isinstance(installed, FlashInferPlatform) and not installed.emulated
