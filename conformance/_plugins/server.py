"""Server scenarios: options, the parametrization (config x model x scenario) and the server pool.

    pytest conformance/test_server_scenarios.py                       # reference server, every tier
    pytest conformance/test_server_scenarios.py --server-cmd "python -m sglang.launch_server \
        --model-path {model_path} --port {port} --tp {tp} --dp {dp} --ep {ep}" --server-configs tp1,tp4-dp4-ep4
    pytest conformance/test_server_scenarios.py --server-url http://127.0.0.1:30000 \
        --server-model-path fixtures/checkpoints/dense-nvfp4_awq-a
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from ..server.configs import ServerConfig, parse_configs, reference_configs
from ..server.launcher import REFERENCE_TEMPLATE, ServerProcess, ServerStartError
from ..server.client import ServerClient
from ..server.models import DEFAULT_MODELS, FixtureModel, ensure_fixture_root
from ..server.scenarios import SCENARIOS, Scenario, fresh_outputs, run_scenario

ATTACHED = ServerConfig(1, device="attached", tier="cpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("nvfp4-server", "NVFP4 W4A16 server scenarios")
    g.addoption("--server-cmd", default=None,
                help="command template starting the server under test; placeholders {python} {model_path} "
                     "{port} {tp} {dp} {ep} {device} (default: the reference server)")
    g.addoption("--server-url", default=None, help="attach to a running server (127.0.0.1 only) instead")
    g.addoption("--server-model-path", default=None,
                help="with --server-url: the fixture checkpoint (<family>-a) it serves (default: from /get_model_info)")
    g.addoption("--server-models", default=",".join(DEFAULT_MODELS),
                help=f"fixture families to serve (default {','.join(DEFAULT_MODELS)})")
    g.addoption("--server-configs", default=None,
                help="parallel configs, e.g. 'tp1,tp2,tp4-dp4-ep4' or 'cpu-tp2' (default: the reference "
                     "server's per-tier list; with --server-cmd: tp1 on CUDA)")
    g.addoption("--server-gpus", type=int, default=None, help="GPU count for the multi_gpu configs (default: detected)")
    g.addoption("--server-timeout", type=float, default=None, help="time limit per scenario in seconds (default 120)")
    g.addoption("--server-start-timeout", type=float, default=240.0, help="time limit for a server to become healthy")
    g.addoption("--server-checkpoints", default=None, help="fixture checkpoint directory (default fixtures/checkpoints)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "batch_invariance: needs batch-size invariant logprobs (not every engine promises it)")
    config.addinivalue_line("markers", "server_scenario: starts or attaches to an inference server")


@dataclass(frozen=True)
class ServerCase:
    config: ServerConfig
    family: str
    scenario: Scenario

    @property
    def id(self) -> str:
        return f"{self.config.id}-{self.family}-{self.scenario.id}"

    @property
    def tier(self) -> str:
        return self.config.tier


def _configs(config: pytest.Config) -> list[ServerConfig]:
    if config.getoption("--server-url"):
        return [ATTACHED]
    spec = config.getoption("--server-configs")
    if spec:
        try:
            return parse_configs(spec)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc
    if config.getoption("--server-cmd"):
        return parse_configs("tp1")
    gpus = config.getoption("--server-gpus")
    if gpus is None:
        from ..tiers import detect_hardware

        gpus = len(detect_hardware().gpus)
    return reference_configs(gpus)


def _families(config: pytest.Config) -> list[str]:
    if config.getoption("--server-url"):
        path = config.getoption("--server-model-path")
        return [FixtureModel.from_checkpoint_path(path).family] if path else ["attached"]
    return [f for f in config.getoption("--server-models").split(",") if f]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "server_case" not in metafunc.fixturenames:
        return
    params = []
    for cfg in _configs(metafunc.config):
        for family in _families(metafunc.config):
            for scenario in SCENARIOS:
                if scenario.needs_tp_baseline and (cfg.world == 1 or cfg is ATTACHED):
                    continue
                case = ServerCase(cfg, family, scenario)
                # one xdist group per server: with `-n N --dist loadgroup` each server starts once
                marks = [getattr(pytest.mark, cfg.tier), pytest.mark.server_scenario,
                         pytest.mark.xdist_group(f"server-{cfg.id}-{family}")]
                marks += [getattr(pytest.mark, m) for m in scenario.marks]
                params.append(pytest.param(case, id=case.id, marks=marks))
    metafunc.parametrize("server_case", params)


class ServerPool:
    """Servers started on demand, one per (config, checkpoint family), stopped at session end."""

    def __init__(self, config: pytest.Config):
        self.pconfig = config
        self.template = config.getoption("--server-cmd") or REFERENCE_TEMPLATE
        self.url = config.getoption("--server-url")
        self.start_timeout = config.getoption("--server-start-timeout")
        self.timeout = config.getoption("--server-timeout")
        self._root = None
        self._servers: dict[tuple[str, str], ServerProcess] = {}
        self._failed: dict[tuple[str, str], str] = {}
        self._fresh: dict[tuple[str, str], list] = {}

    def root(self):
        if self._root is None:
            self._root = ensure_fixture_root(self.pconfig.getoption("--server-checkpoints"))
        return self._root

    def model(self, family: str) -> FixtureModel:
        if family == "attached":
            info = ServerClient(self.url).model_info()
            return FixtureModel.from_checkpoint_path(info["model_path"])
        if self.url:
            return FixtureModel.from_checkpoint_path(self.pconfig.getoption("--server-model-path"))
        return FixtureModel(family, self.root())

    def client(self, cfg: ServerConfig, model: FixtureModel) -> ServerClient:
        key = (cfg.id, model.family)
        if cfg is ATTACHED:
            client = ServerClient(self.url)
            if key not in self._fresh:
                self._fresh[key] = fresh_outputs(client)
            return client
        if key in self._failed:
            pytest.fail(f"server {key} failed to start earlier:\n{self._failed[key]}", pytrace=False)
        server = self._servers.get(key)
        if server is None or server.proc.poll() is not None:
            try:
                server = ServerProcess(self.template, self.start_timeout, model_path=model.a, tp=cfg.tp, dp=cfg.dp,
                                       ep=cfg.ep, device=cfg.device)
            except ServerStartError as exc:
                self._failed[key] = str(exc)
                raise
            self._servers[key] = server
            client = ServerClient(server.url)
            self._fresh[key] = fresh_outputs(client)
            return client
        return ServerClient(server.url)

    def run(self, case: ServerCase) -> None:
        model = self.model(case.family)
        client = self.client(case.config, model)
        baseline = self.client(case.config.single_rank(), model) if case.scenario.needs_tp_baseline else None
        fresh = self._fresh.get((case.config.id, model.family))
        run_scenario(case.scenario, client, model, baseline, case.config.tp, self.timeout, fresh)

    def stop_all(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest):
    pool = ServerPool(request.config)
    yield pool
    pool.stop_all()
