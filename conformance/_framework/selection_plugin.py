"""The one selection plugin: ``--backend``, ``--engine``, ``--server-api`` and ``--rules-profile``, each a built-in
name from the one table (:mod:`conformance._framework.selection`) or ``module:attr``, each with one environment
variable (:data:`conformance._framework.selection.OPTIONS`), read when the option is resolved (not when it is
registered), resolved once per session and kept in the config's stash (:func:`selected`); a name that cannot be
loaded is a usage error naming the option. The areas' fixtures take their implementation from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from conformance.interfaces.kernel import Backend
from conformance._framework import selection
from conformance._framework.data import data_path

_SELECTED_KEY = pytest.StashKey["Selected"]()
_BACKENDS_KEY = pytest.StashKey[list]()


def _names(*interfaces: str) -> str:
    return ", ".join(dict.fromkeys(n for i in interfaces for n in selection.names_for(i)))


def _profiles() -> str:
    return ", ".join(sorted(p.stem for p in data_path("config_rules", "profiles").glob("*.json")))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nvfp4", "NVFP4 W4A16 conformance")
    env = {flag: opt.env for flag, opt in selection.OPTIONS.items()}
    engine = selection.OPTIONS["--engine"]
    group.addoption("--backend", default=None,
                    help=f"backend under test: a built-in name ({_names('kernel')}) or module:attr, several "
                         f"separated by commas (default: ${env['--backend']} or '{selection.DEFAULT_BACKEND}')")
    group.addoption("--engine", default=None,
                    help=f"engine under test: a built-in name ({_names('rules', 'layer_code')}) or module:attr naming "
                         f"a RulesEngine (configuration rules) and/or LayerCodeEngine (layer code under the harness) "
                         f"subclass; default: ${engine.env}, else '{engine.defaults['rules']}' for the rules and "
                         f"'{engine.defaults['layer_code']}' for the harness (the reference has no layer code)")
    group.addoption("--server-api", default=None, metavar="|".join(selection.names_for("server")),
                    help=f"the API the server scenarios speak (a built-in name or module:attr; default "
                         f"${env['--server-api']} or {selection.OPTIONS['--server-api'].defaults['server']}); a "
                         f"comma-separated list runs the scenarios through each, on the same servers; scenarios "
                         f"needing an endpoint the API lacks skip with the reason")
    group.addoption("--rules-profile", default=None,
                    help=f"rules profile whose expected outcomes the rule matrices use: {_profiles()} (default: "
                         f"${env['--rules-profile']}, else the engine's own profile, else sglang-0.5.23)")


@dataclass(frozen=True)
class Selected:
    """What the session's options select (the command line, else the environment variable, else the default).
    ``engine`` and ``rules_profile`` are None when neither names one (each interface then takes its default);
    ``engine_named``: ``--engine`` was given on the command line (an engine asked for by name that cannot run
    fails instead of skipping)."""

    backend: str
    engine: str | None
    engine_named: bool
    server_apis: tuple[str, ...]
    rules_profile: str | None
    raw: dict[str, str | None] = field(default_factory=dict, repr=False)

    def engine_for(self, interface: str) -> str:
        """The engine spec for ``rules`` or ``layer_code`` (the option's per-interface default when unnamed)."""
        return self.engine or selection.OPTIONS["--engine"].defaults[interface]


def selected(config: pytest.Config) -> Selected:
    """The session's selection, resolved once (environment variables are read here, not at registration)."""
    found = config.stash.get(_SELECTED_KEY, None)
    if found is None:
        raw = {flag: config.getoption(flag, default=None) for flag in selection.OPTIONS}
        apis = selection.option_value("--server-api", raw["--server-api"], "server") or ""
        found = Selected(
            backend=selection.option_value("--backend", raw["--backend"], "kernel"),
            engine=selection.option_value("--engine", raw["--engine"], "none"),
            engine_named=bool(raw["--engine"]),
            server_apis=tuple(a.strip() for a in apis.split(",") if a.strip()),
            rules_profile=selection.option_value("--rules-profile", raw["--rules-profile"], "none"),
            raw=raw,
        )
        config.stash[_SELECTED_KEY] = found
    return found


def backends_of(config: pytest.Config) -> list[Backend]:
    """The backends ``--backend`` (or its environment variable) selects, loaded once per session."""
    cached = config.stash.get(_BACKENDS_KEY, None)
    if cached is None:
        try:
            cached = selection.load_backends(selected(config).backend)
        except selection.SelectionError as exc:
            raise pytest.UsageError(f"--backend: {exc}") from exc
        config.stash[_BACKENDS_KEY] = cached
    return cached


def pytest_report_header(config: pytest.Config) -> str:
    try:
        names = ", ".join(f"{b.name} ({b.version()})" for b in backends_of(config))
    except pytest.UsageError as exc:
        return f"nvfp4 backend: {exc}"
    return f"nvfp4 backend under test: {names}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        backends = backends_of(metafunc.config)
        metafunc.parametrize("backend", backends, ids=[b.name for b in backends], scope="session")
