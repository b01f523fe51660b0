"""Server scenarios: options, the parametrization (config x model x scenario) and the server pool.

    pytest conformance/server/test_server_scenarios.py                       # reference server, every tier
    pytest conformance/server/test_server_scenarios.py --server-cmd "python -m sglang.launch_server \
        --model-path {model_path} --port {port} --tp {tp} --dp {dp} --ep {ep}" --server-configs tp1,tp4-dp4-ep4
    pytest conformance/server/test_server_scenarios.py --server-checkpoint /ckpts/llama-nvfp4 --tokenizer /hf/llama
    pytest conformance/server/test_server_scenarios.py --server-url http://127.0.0.1:30000 \
        --server-model-path fixtures/checkpoints/dense-nvfp4_awq-a
    pytest conformance/server/test_server_scenarios.py --server-api vllm --server-cmd "vllm serve {model_path} ..."
    pytest conformance/server/test_server_scenarios.py --server-api openai,vllm --server-cmd ...   # both, one server

Test ids start with the API: ``test_server_scenario[<api>-<config>-<model>-<scenario>]``. With several APIs
each server is started once and serves all of them, its scenarios running API by API in the order given
(``openai,vllm``: the start-up-weight scenarios first, then the reloading ones).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import os
import time
import warnings

import pytest

from conformance._framework import selection
from conformance._framework.selection_plugin import selected
from conformance.server.configs import ServerConfig, parse_configs, reference_configs
from conformance.server.launcher import REFERENCE_TEMPLATE, ServerProcess, ServerStartError
from conformance.server.dialects import DIALECTS, ServerDialect, dialect_class, make_dialect
from conformance.server.models import (DEFAULT_MODELS, SERVED_WEIGHTS, ModelCatalog, ModelError, ServedModel,
                                      remove_work_dir, work_dir)
from conformance.server.scenarios import SCENARIOS, Scenario, calibrate, fresh_outputs, run_scenario, workload_scenario

ATTACHED = ServerConfig(1, device="attached", tier="cpu")
SERVER_API_ENV = selection.OPTIONS["--server-api"].env
START_TIMEOUT_S = 240.0


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
    g.addoption("--server-checkpoint", action="append", default=[], metavar="PATH",
                help="serve your own ModelOpt NVFP4 / NVFP4_AWQ / W4A16_NVFP4 checkpoint (HF layout; repeatable) "
                     "instead of the fixtures; it is only read: the second weight set and the corrupt checkpoint "
                     "are derived into a temporary directory the suite removes")
    g.addoption("--server-weights", default="nvfp4", choices=SERVED_WEIGHTS,
                help="what the server is given: the NVFP4 checkpoints (default), or 'bf16': BF16-dequantized "
                     "copies of every weight set (a, b, corrupt), made by the suite into a temporary directory, "
                     "for an engine without an NVFP4 kernel on this hardware (e.g. vLLM on CPU); reloads point "
                     "at the copies, the truth stays the NVFP4 originals'")
    g.addoption("--tokenizer", default=None, metavar="PATH",
                help="tokenizer.json (or a directory holding one) for --server-checkpoint checkpoints without one")
    g.addoption("--server-configs", default=None,
                help="parallel configs, e.g. 'tp1,tp2,tp4-dp4-ep4' or 'cpu-tp2' (default: the reference "
                     "server's per-tier list; with --server-cmd: tp1 on CUDA)")
    g.addoption("--server-gpus", type=int, default=None, help="GPU count for the multi_gpu configs (default: detected)")
    g.addoption("--server-timeout", type=float, default=None,
                help="a fixed ceiling per scenario in seconds (default: none; each request is bounded by the "
                     "server's own pace, measured after start-up, and a slow server is told from a lost request "
                     "by probing it: docs/server.md 'Time limits')")
    g.addoption("--server-batch-invariant", action="store_true", default=None,
                help="the server under test promises batch invariance (e.g. vLLM with VLLM_BATCH_INVARIANT=1): "
                     "concurrent requests must give the outputs they give alone, bit for bit (without it they "
                     "are judged against the truth; explicit batches are compared bit for bit either way). "
                     "Default: on for the reference server the suite starts itself, off otherwise")
    g.addoption("--server-start-timeout", type=float, default=START_TIMEOUT_S,
                help=f"time limit for a server to become healthy, in seconds (default {START_TIMEOUT_S:g})")
    g.addoption("--truth-device", default=None, metavar="DEVICE",
                help="where the reference's fp64 golden truth of --server-checkpoint checkpoints runs (and the "
                     "on-demand gaps, branches and teacher-forced paths of every model), e.g. cuda, cuda:1, cpu "
                     "(default: cuda if available, else cpu)")
    g.addoption("--truth-precision", default="fp64", choices=("fp64", "fp32"),
                help="the workload truth's variance estimates: fp64 (default), or, for dense checkpoints, from an "
                     "fp32 pass (values still fp64; several times faster on a GPU; docs/truth.md 'Precision')")
    g.addoption("--workload", default=None, metavar="NAME|FILE",
                help="add the workload scenario: 'quick' (the tiny fixtures on CPU), 'standard' (real checkpoints "
                     "on a GPU) or a TOML file of conformance/server/workloads.py's fields; every prompt position "
                     "and generated token is judged, per phase and token-count bucket (docs/server.md "
                     "'Workloads'); the coverage map goes to --report-dir")
    g.addoption("--server-checkpoints", default=None,
                help="a fixture build made with `python -m nvfp4_conformance_fixtures.make_checkpoints --out DIR` (read only; "
                     "default: fixtures/checkpoints in a clone, the user's cache (~/.cache/nvfp4-w4a16-conformance/"
                     "checkpoints) for a pip-installed suite, built on first use)")


def pytest_configure(config: pytest.Config) -> None:
    apis = server_apis(config)
    problems = []
    for api in apis:
        try:
            dialect_class(api)
        except ValueError as exc:
            problems.append(str(exc))
    if problems or not apis or len(set(apis)) != len(apis):
        raise pytest.UsageError(f"--server-api {','.join(apis)!r} (or ${SERVER_API_ENV}): known APIs: "
                                f"{', '.join(DIALECTS)} or module:attr (one, or a comma-separated list without "
                                f"repeats)" + "".join(f"; {p}" for p in problems))
    config.addinivalue_line("markers", "batch_invariance: needs batch-size invariant logprobs (not every engine promises it)")
    config.addinivalue_line("markers", "workload: the --workload scenario (every position judged, per token-count bucket)")
    config.addinivalue_line("markers", "server_scenario: starts or attaches to an inference server")
    if getattr(config.option, "dist", None) == "load":
        # `-n N` alone means "load"; with "loadgroup" (the same for tests without a group) each server's
        # scenarios run in one worker, so a server starts once instead of once per worker
        config.option.dist = "loadgroup"
    truth_device(config)  # an unusable device is a usage error at start
    checkpoints = config.getoption("--server-checkpoint")
    if config.getoption("--tokenizer") and not checkpoints:
        raise pytest.UsageError("--tokenizer applies to --server-checkpoint checkpoints (the fixtures have their own)")
    if checkpoints and config.getoption("--server-url") and len(checkpoints) != 1:
        raise pytest.UsageError("--server-url serves one checkpoint: give one --server-checkpoint")
    try:  # clear errors at start, before any server: a missing or unfitting tokenizer, not a checkpoint
        _catalog(config).check_user_checkpoints()
    except ModelError as exc:
        raise pytest.UsageError(str(exc)) from exc
    bf16 = config.getoption("--server-weights") == "bf16"
    if bf16 and config.getoption("--server-url"):
        raise pytest.UsageError("--server-weights bf16 needs the suite to start the server (--server-cmd): the "
                                "copies it serves are made at session start")
    if (checkpoints or bf16) and not hasattr(config, "workerinput"):
        # the controller owns the work directory; pytest-xdist workers inherit its path
        config._nvfp4_server_work_dir = work_dir()


def server_apis(config: pytest.Config) -> list[str]:
    return list(selected(config).server_apis)


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "_nvfp4_server_work_dir", None) is not None:  # the controller: workers are done
        remove_work_dir()


@dataclass(frozen=True)
class ServerCase:
    config: ServerConfig
    model: str
    scenario: Scenario
    api: str = "sglang"

    @property
    def id(self) -> str:
        return f"{self.api}-{self.config.id}-{self.model}-{self.scenario.id}"

    @property
    def tier(self) -> str:
        return self.config.tier

    def servers(self) -> list[tuple[str, str]]:
        """The (config id, model) of every server this case talks to."""
        keys = [(self.config.id, self.model)]
        if self.scenario.needs_tp_baseline:
            keys.append((self.config.single_rank().id, self.model))
        return keys


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
        from conformance._framework.tiers import detect_hardware

        gpus = len(detect_hardware().gpus)
    return reference_configs(gpus)


_CATALOG_KEY = pytest.StashKey[ModelCatalog]()


def _catalog(config: pytest.Config) -> ModelCatalog:
    """The session's model catalog, built once per process from the options (kept in the config's stash)."""
    catalog = config.stash.get(_CATALOG_KEY, None)
    if catalog is None:
        catalog = config.stash[_CATALOG_KEY] = _build_catalog(config)
    return catalog


def _build_catalog(config: pytest.Config) -> ModelCatalog:
    families = [f for f in config.getoption("--server-models").split(",") if f]
    root = config.getoption("--server-checkpoints")
    if config.getoption("--server-url") and not config.getoption("--server-checkpoint"):
        path = config.getoption("--server-model-path")
        if path:  # a fixture checkpoint <family>-a in some build directory
            p = Path(path)
            if not p.name.endswith("-a"):
                raise pytest.UsageError(f"--server-model-path {path!r} is not a fixture checkpoint <family>-a")
            families, root = [p.name[:-2]], str(p.parent)
        else:
            families = ["attached"]
    return ModelCatalog(families, root, config.getoption("--server-checkpoint"), config.getoption("--tokenizer"),
                        config.getoption("--server-weights"), truth_device(config))


def truth_device(config: pytest.Config) -> str:
    """``--truth-device``, checked at once (a clear error before any server starts), else the default."""
    from reference_impl.truth.engine import default_device, resolve_device

    try:
        return str(resolve_device(config.getoption("--truth-device") or default_device()))
    except ValueError as exc:
        raise pytest.UsageError(f"--truth-device: {exc}") from exc


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "server_case" not in metafunc.fixturenames:
        return
    params = []
    # model by model (each model's servers finish before the next model's start: ServerPool.release), then
    # config, then API in the order given
    for name in _catalog(metafunc.config).names():
        for cfg in _configs(metafunc.config):
            for api in server_apis(metafunc.config):
                for scenario in SCENARIOS + _workload_scenarios(metafunc.config):
                    if scenario.needs_tp_baseline and (cfg.world == 1 or cfg is ATTACHED):
                        continue
                    case = ServerCase(cfg, name, scenario, api)
                    # one xdist group per server: with `-n N --dist loadgroup` each server starts once
                    marks = [getattr(pytest.mark, cfg.tier), pytest.mark.server_scenario,
                             pytest.mark.xdist_group(f"server-{cfg.id}-{name}")]
                    marks += [getattr(pytest.mark, m) for m in scenario.marks]
                    params.append(pytest.param(case, id=case.id, marks=marks))
    metafunc.parametrize("server_case", params)


def _workload_scenarios(config: pytest.Config) -> tuple[Scenario, ...]:
    spec = config.getoption("--workload")
    if not spec:
        return ()
    from conformance.server.workloads import load

    try:
        workload = load(spec)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    report, precision = config.getoption("--report-dir"), config.getoption("--truth-precision")
    return (workload_scenario(workload, truth_device(config), Path(report) if report else None, precision),)


class ServerPool:
    """Servers started on demand, one per (config, model), each stopped after the last test of the session
    that uses it (under pytest-xdist a worker may not run that test: then at session end)."""

    def __init__(self, config: pytest.Config, session: pytest.Session | None = None, log_dir: Path | None = None):
        self.pconfig, self.session = config, session
        self.log_dir = log_dir  # server logs (pytest's temporary directory); a passing server's log is removed
        self._last_use: dict[tuple[str, str], str] | None = None
        self.template = config.getoption("--server-cmd") or REFERENCE_TEMPLATE
        self.url = config.getoption("--server-url")
        self.apis = server_apis(config)
        self.api = self.apis[0]  # the one a server is started and health-polled with
        self.start_timeout = config.getoption("--server-start-timeout")
        self.timeout = config.getoption("--server-timeout")
        self.catalog = _catalog(config)
        self._servers: dict[tuple[str, str], ServerProcess] = {}
        self._failed: dict[tuple[str, str], str] = {}
        self._fresh: dict[tuple[str, str], list] = {}
        self._pace: dict[tuple[str, str], object] = {}  # (config id, model) -> the server's Pace
        declared = config.getoption("--server-batch-invariant")
        # the reference server is batch invariant by construction (fp64 per sequence, whatever the batch)
        self.batch_invariant = bool(declared) if declared is not None else not (
            config.getoption("--server-cmd") or self.url)

    def model(self, name: str) -> ServedModel:
        try:
            if name == "attached":  # a fixture checkpoint <family>-a, as the running server reports it
                path = Path(make_dialect(self.api, self.url).model_path())
                if not path.name.endswith("-a"):
                    pytest.fail(f"the attached server serves {path}, not a fixture checkpoint <family>-a: pass "
                                f"--server-checkpoint {path} (and --tokenizer) instead", pytrace=False)
                self.catalog.serve_fixture_dir(path.parent, path.name[:-2])
                name = path.name[:-2]
            return self.catalog.served(name)
        except ModelError as exc:
            pytest.fail(str(exc), pytrace=False)

    def client(self, cfg: ServerConfig, model: ServedModel, api: str | None = None) -> ServerDialect:
        api, key = api or self.api, (cfg.id, model.name)
        if cfg is ATTACHED:
            client = make_dialect(api, self.url)
            if key not in self._fresh:
                self._fresh[key] = fresh_outputs(client)
                self._pace[key] = calibrate(client, None)
            return client.with_deadline(None, self._pace[key])
        if key in self._failed:
            pytest.fail(f"server {key} failed to start earlier:\n{self._failed[key]}", pytrace=False)
        server = self._servers.get(key)
        if server is not None and (server.proc.poll() is not None or not self._healthy(server.url)):
            # it died (or stopped answering) in an earlier scenario, which reported that: later scenarios get
            # a new server instead of failing for the same reason
            warnings.warn(f"server {key} is gone or unhealthy after an earlier scenario: starting a new one "
                          f"(log of the old one: {server.log.name})", stacklevel=1)
            server.failed = True  # keep the log the warning names
            server.stop()
            server = None
        if server is None:
            try:
                server = ServerProcess(self.template, self.start_timeout, env=self._launch_env(),
                                       model_path=model.a, tokenizer_path=model.tokenizer, tp=cfg.tp, dp=cfg.dp,
                                       ep=cfg.ep, device=cfg.device, api=self.api, log_dir=self.log_dir)
            except ServerStartError as exc:
                self._failed[key] = str(exc)
                raise
            self._servers[key] = server
            startup_s = time.monotonic() - server.started_at
            first = make_dialect(self.api, server.url, max_request_s=self.start_timeout)  # before any pace
            self._fresh[key] = fresh_outputs(first)
            self._pace[key] = calibrate(first, startup_s)
            first.close()
        return make_dialect(api, server.url).with_deadline(None, self._pace[key])

    def _healthy(self, url: str) -> bool:
        """Healthy by every API of the session (an OpenAI API may list its model while the engine is dead)."""
        return all(make_dialect(api, url).healthy() for api in self.apis)

    def _launch_env(self) -> dict[str, str]:
        """What the other APIs of this session need of a server (the first API's the launcher sets itself),
        unless the environment has it."""
        env: dict[str, str] = {}
        for api in self.apis[1:]:
            env.update({k: v for k, v in dialect_class(api).launch_env.items() if k not in os.environ})
        return env

    def run(self, case: ServerCase, record_property=None) -> None:
        reason = case.scenario.skip_reason(dialect_class(case.api))
        if reason:  # before starting a server for it
            pytest.skip(reason)
        model = self.model(case.model)
        try:
            truths = {s: self.catalog.truth(model, s) for s in ("a", "b")}
        except ModelError as exc:
            pytest.fail(str(exc), pytrace=False)
        client = self.client(case.config, model, case.api)
        baseline = self.client(case.config.single_rank(), model, case.api) if case.scenario.needs_tp_baseline else None
        fresh = self._fresh.get((case.config.id, model.name))
        try:
            result = run_scenario(case.scenario, client, model, truths, baseline, case.config.tp, self.timeout,
                                  fresh, self.batch_invariant)
        except Exception as exc:
            report = self.died(case.config, model)
            if report is None:
                raise
            pytest.fail(f"{exc}\n{report}", pytrace=False)
        if record_property is not None:
            record_property("server_api", case.api)
            record_property("golden_tokens_compared", result.compared)
            record_property("bound_ratio", round(result.worst_ratio, 4))
            pace = client.pace
            if pace is not None:
                record_property("server_pace", f"{pace.calibration.describe()}; slowest probe {pace.slowest:.1f}x")
            for note in result.observations:
                record_property("observation", note)

    def died(self, cfg: ServerConfig, model: ServedModel) -> str | None:
        """The exit code and log of the started server of ``cfg`` that exited mid-scenario, else None."""
        server = self._servers.get((cfg.id, model.name))
        return server.failure_report() if server is not None else None

    def release(self, nodeid: str) -> None:
        """Stop the servers whose last use (in the session's test order) was test ``nodeid``: heavyweight
        engines then run one (or a TP baseline and one) at a time."""
        if self.session is None:
            return
        if self._last_use is None:
            self._last_use = {}
            for item in self.session.items:
                case = getattr(getattr(item, "callspec", None), "params", {}).get("server_case")
                if isinstance(case, ServerCase):
                    self._last_use.update({key: item.nodeid for key in case.servers()})
        for key, last in self._last_use.items():
            if last == nodeid and key in self._servers:
                self._servers.pop(key).stop()

    def stop_all(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    pool = ServerPool(request.config, request.session, tmp_path_factory.mktemp("server-logs"))
    yield pool
    pool.stop_all()
