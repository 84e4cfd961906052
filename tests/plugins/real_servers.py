"""The real-server fixtures, and the hooks that serve them (a pytest plugin, registered by
tests/conftest.py).

Real-server fixtures (the REAL LMCache MP server, run from its own venv built by
``harness/build_lmcache_venv.sh``: ``.lmcache-venv`` for 0.5.6,
``.lmcache-venv-057`` for the 0.5.7rc3 generation):

* ``lmcache_python`` (session): Path of the lmcache venv's python. The venv is
  built once per session, before the first test runs (in
  ``pytest_collection_finish``, outside the per-test timeout), and only when a
  selected test needs it. A cold build takes ~70 s; a built venv ~0.1 s.
* ``real_server_shm`` / ``real_server_pickle`` (session): a started
  :class:`RealLMCacheServer`, ``--supported-transfer-mode auto``, L1 1 GB, LRU,
  **chunk size 16** (``SESSION_CHUNK_SIZE``) so tests can use small tensors.
  "shm" = ``--shm-name lmca_<pid>_<hex> --no-l1-use-lazy``; "pickle" =
  ``--shm-name ""``. They are SHARED by every test of the session: use
  distinct model names / token ids per test, and never stop or restart them
  (use ``fresh_real_server`` for that).
* ``real_server`` (function, parametrized ``["shm", "pickle"]``, ids
  ``shm``/``pickle``): the matching session server of the generation given by the
  ``generation`` fixture: 0.5.6, unless the test parametrizes ``generation``
  (``@pytest.mark.parametrize("generation", ["0.5.7"])``; the venv of 0.5.7 is then
  built before the first test too).
* ``fresh_real_server`` (function): a factory ``make(mode="shm",
  generation="0.5.6", **kw)`` returning a NEW started server of its own (kw go
  to :class:`RealLMCacheServer`; ``chunk_size`` defaults to 16 here too); all
  servers it made get SIGTERM at teardown and are waited for and checked (no
  process, no ``/dev/shm`` segment left) on a reaper thread while the next tests
  run (a shutdown is ~1.5 s, nearly all idle); what any left fails the session's
  end, naming the test. For restart tests (``server.restart()`` keeps
  ports and shm name).
* ``module_real_server`` (module, parametrized indirectly with a dict of
  ``fresh_real_server``'s arguments): a server of the module's own, shared by the
  tests that ask for the same arguments (pytest runs them together, so one is alive
  at a time), stopped and checked (as ``fresh_real_server``'s) after the last of them: for tests that need a
  server no other module uses (they clear it, count its sessions) but not one each.
* The 0.5.7 generation: ``lmcache057_python`` (session, the 0.5.7 venv's
  python), ``real_server_057_shm`` / ``real_server_057_pickle`` (session,
  chunk size 16, like the 0.5.6 ones) and ``real_server_057`` (function,
  parametrized ``shm``/``pickle``). The 0.5.7 venv is built before the first
  test when a selected test uses one of these fixtures, or a real-server fixture with
  ``generation`` parametrized to 0.5.7 (a ``fresh_real_server(generation="0.5.7")`` call
  in any other test builds it, inside that test's timeout).

Every test that uses any of these fixtures (directly or through another
fixture) is marked ``real_server`` automatically, so developers without the
lmcache venv can deselect them with ``-m "not real_server"``. If building the
venv or starting a server fails, the fixture FAILS the test (``pytest.fail``)
-- it never skips, locally or in CI (``CI=true`` /
``LMCACHE_ASYNC_REQUIRE_REAL_SERVER=1`` only change the message).

When a test that used a real server fails, the tails of the server logs are
printed in its teardown section. At session end it is asserted that no server
process started here is alive and no shm segment it created remains.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.real_server import (
    Generation,
    LMCacheServerError,
    RealLMCacheServer,
    lmcache_venv_python,
)
from tests.helpers import SESSION_CHUNK_SIZE

#: Server startup deadline (s); a start takes ~2-3 s on 2 vCPUs.
SERVER_START_TIMEOUT = 60.0

#: Fixtures that need the real server. Tests whose fixture closure contains one
#: of these get the ``real_server`` marker. A fixture that reaches a real
#: server only through ``request.getfixturevalue(...)`` is invisible to that
#: static check: add its name here (``REAL_SERVER_FIXTURES.add("name")``) or
#: give its params ``pytest.param(..., marks=pytest.mark.real_server)``.
REAL_SERVER_FIXTURES: set[str] = {
    "lmcache_python",
    "real_server",
    "real_server_shm",
    "real_server_pickle",
    "fresh_real_server",
    "module_real_server",
    "lmcache057_python",
    "real_server_057",
    "real_server_057_shm",
    "real_server_057_pickle",
}
#: The fixtures that need the 0.5.7 venv (built before the first test only if one is selected).
REAL_SERVER_057_FIXTURES: set[str] = {
    "lmcache057_python",
    "real_server_057",
    "real_server_057_shm",
    "real_server_057_pickle",
}

#: Per generation: the venv's python, or the build error.
_venv_key = pytest.StashKey[dict[Generation, tuple[Path | None, str | None]]]()
_report_key = pytest.StashKey[dict[str, pytest.TestReport]]()


def _require_real_server() -> bool:
    return (
        os.environ.get("CI", "").lower() == "true"
        or os.environ.get("LMCACHE_ASYNC_REQUIRE_REAL_SERVER") == "1"
    )


def _fail(what: str, err: BaseException | str) -> None:
    hint = (
        "(CI / LMCACHE_ASYNC_REQUIRE_REAL_SERVER=1: real-server tests are required)"
        if _require_real_server()
        else "(deselect real-server tests locally with -m 'not real_server')"
    )
    pytest.fail(f"{what} {hint}:\n{err}", pytrace=False)


# --------------------------------------------------------------------------- hooks


@pytest.hookimpl(tryfirst=True)  # before -m deselection looks at the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & REAL_SERVER_FIXTURES:
            item.add_marker(pytest.mark.real_server)


def _build_venv(config: pytest.Config, generation: Generation) -> tuple[Path | None, str | None]:
    """The generation's venv python or its build error, built at most once per session."""
    built = config.stash.setdefault(_venv_key, {})
    if generation not in built:
        try:
            built[generation] = (lmcache_venv_python(generation=generation), None)
        except Exception as exc:  # reported by the fixture that needs it
            built[generation] = (None, str(exc))
    return built[generation]


def _venv_python(config: pytest.Config, generation: Generation) -> Path:
    """The generation's venv python; FAILS the test (never skips) when it cannot be built."""
    python, error = _build_venv(config, generation)
    if error is not None or python is None:
        _fail(f"could not build the lmcache {generation} venv", error or "unknown error")
    assert python is not None
    return python


def _needs_057(item: pytest.Item) -> bool:
    """The test uses a 0.5.7 fixture, or a real-server fixture with ``generation`` 0.5.7."""
    names = set(getattr(item, "fixturenames", ()))
    if names & REAL_SERVER_057_FIXTURES:
        return True
    callspec = getattr(item, "callspec", None)
    return (
        bool(names & REAL_SERVER_FIXTURES)
        and callspec is not None
        and callspec.params.get("generation") == "0.5.7"
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the lmcache venvs before any test runs (outside the per-test
    timeout), each only if a selected test needs it."""
    if session.config.option.collectonly:
        return
    wanted: list[Generation] = []
    if any(item.get_closest_marker("real_server") for item in session.items):
        wanted.append("0.5.6")
    if any(_needs_057(item) for item in session.items):
        wanted.append("0.5.7")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for generation in wanted:
        if reporter is not None:
            reporter.write_line(
                f"preparing the lmcache {generation} venv "
                f"(harness/build_lmcache_venv.sh --generation {generation})"
            )
        _build_venv(session.config, generation)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    item.stash.setdefault(_report_key, {})[report.when] = report
    return report


def _test_failed(node: pytest.Item) -> bool:
    reports = node.stash.get(_report_key, {})
    return any(r.failed for w, r in reports.items() if w in ("setup", "call"))


def _print_log_tails(node: pytest.Item, servers: list[RealLMCacheServer]) -> None:
    for srv in servers:
        print(f"\n===== {node.nodeid}: log tail of {srv!r} ({srv.log_path}) =====")
        print(srv.log_tail(60))


# --------------------------------------------------------------------------- fixtures


class _Registry:
    """Every server started by these fixtures, for the end-of-session check."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers: list[RealLMCacheServer] = []
        # Stops that tests do not wait for: a server takes ~1.5-2 s to shut down after
        # SIGTERM, nearly all of it idle (~0.1 s of CPU), and nothing after its test needs
        # it gone (the next servers get other ports and SHM names).
        self._reaper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-server-reaper")
        self._reaped: list[concurrent.futures.Future[list[str]]] = []

    def stop_later(self, servers: list[RealLMCacheServer], what: str) -> None:
        """SIGTERM ``servers`` now; wait for them and check what they left (no process, no
        ``/dev/shm`` segment) on a thread of their own, while the next tests run. Every
        problem is reported, with ``what`` (the test or module), at the end of the session."""
        for srv in servers:
            srv.terminate()
        self._reaped.append(self._reaper.submit(_stop_and_list, list(servers), what))

    def problems(self) -> list[str]:
        """What every stop left (waiting for the ones still under way), then every server
        registered, stopped (idempotent) and checked again."""
        problems = [p for future in self._reaped for p in future.result()]
        self._reaper.shutdown()
        for srv in self.servers:
            srv.stop()
            problems += [f"{srv!r}: {p}" for p in srv.leftovers()]
        return problems

    def start(self, mode: str, python: Path, **kw: Any) -> RealLMCacheServer:
        kw.setdefault("chunk_size", SESSION_CHUNK_SIZE)
        kw.setdefault("log_dir", self.log_dir)
        srv = RealLMCacheServer(mode, venv_python=python, **kw)  # type: ignore[arg-type]
        self.servers.append(srv)
        try:
            srv.start(timeout=SERVER_START_TIMEOUT)
        except LMCacheServerError as exc:
            srv.stop()
            _fail(f"could not start the real LMCache {srv.generation} server (mode={mode})", exc)
        return srv

    def start_together(self, *specs: tuple[str, Path, dict[str, Any]]) -> list[RealLMCacheServer]:
        """:meth:`start` for each ``(mode, python, kw)`` at once: a start is ~3 s, mostly
        lmcache's imports on one CPU, and several overlap. Raises the first failure (the
        servers that did start are registered, so stopped and checked at session end)."""
        return _together([functools.partial(self.start, mode, python, **kw) for mode, python, kw in specs])


@pytest.fixture(scope="session")
def _real_server_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Registry]:
    reg = _Registry(tmp_path_factory.mktemp("lmcache_server_logs"))
    yield reg
    # Runs after every server fixture (they all depend on this one). The
    # session servers were only sent SIGTERM (so they shut down in parallel), the
    # fresh and module servers are stopped by the reaper; wait for them here, then
    # check that nothing is left.
    problems = reg.problems()
    assert not problems, "real-server leftovers:\n" + "\n".join(problems)


@pytest.fixture(scope="session")
def lmcache_python(pytestconfig: pytest.Config) -> Path:
    """Path of the lmcache 0.5.6 venv's python (built once per session)."""
    return _venv_python(pytestconfig, "0.5.6")


@pytest.fixture(scope="session")
def lmcache057_python(pytestconfig: pytest.Config) -> Path:
    """Path of the lmcache 0.5.7rc3 venv's python (built once per session)."""
    return _venv_python(pytestconfig, "0.5.7")


def _session_server(
    registry: _Registry, python: Path, mode: str, generation: Generation = "0.5.6"
) -> Iterator[RealLMCacheServer]:
    label = "session" if generation == "0.5.6" else "session057"
    srv = registry.start(mode, python, name=f"{label}_{mode}", generation=generation)
    yield srv
    srv.terminate()  # _real_server_registry's teardown waits and checks


@pytest.fixture(scope="session")
def real_server_shm(_real_server_registry: _Registry, lmcache_python: Path) -> Iterator[RealLMCacheServer]:
    """Shared SHM-mode server (chunk size 16) for the whole session."""
    yield from _session_server(_real_server_registry, lmcache_python, "shm")


@pytest.fixture(scope="session")
def real_server_pickle(_real_server_registry: _Registry, lmcache_python: Path) -> Iterator[RealLMCacheServer]:
    """Shared pickle-mode server (chunk size 16) for the whole session."""
    yield from _session_server(_real_server_registry, lmcache_python, "pickle")


@pytest.fixture
def generation() -> Generation:
    """The server generation of ``real_server``: 0.5.6, unless the test parametrizes it
    (``@pytest.mark.parametrize("generation", ["0.5.7"])``, or both generations)."""
    return "0.5.6"


@pytest.fixture(params=["shm", "pickle"])
def real_server(request: pytest.FixtureRequest, generation: Generation) -> RealLMCacheServer:
    """The session server of ``generation`` (0.5.6 unless parametrized) of each transport,
    in turn."""
    label = "" if generation == "0.5.6" else "057_"
    srv: RealLMCacheServer = request.getfixturevalue(f"real_server_{label}{request.param}")
    if not srv.is_running():
        _fail(f"the shared {generation} {request.param} server is not running", srv.log_tail(40))
    return srv


@pytest.fixture(scope="session")
def real_server_057_shm(
    _real_server_registry: _Registry, lmcache057_python: Path
) -> Iterator[RealLMCacheServer]:
    """Shared 0.5.7rc3 SHM-mode server (chunk size 16) for the whole session."""
    yield from _session_server(_real_server_registry, lmcache057_python, "shm", "0.5.7")


@pytest.fixture(scope="session")
def real_server_057_pickle(
    _real_server_registry: _Registry, lmcache057_python: Path
) -> Iterator[RealLMCacheServer]:
    """Shared 0.5.7rc3 inline-mode (``--shm-name ""``) server (chunk size 16) for the session."""
    yield from _session_server(_real_server_registry, lmcache057_python, "pickle", "0.5.7")


@pytest.fixture(params=["shm", "pickle"])
def real_server_057(request: pytest.FixtureRequest) -> RealLMCacheServer:
    """The 0.5.7rc3 session server of each transport, in turn."""
    srv: RealLMCacheServer = request.getfixturevalue(f"real_server_057_{request.param}")
    if not srv.is_running():
        _fail(f"the shared 0.5.7 {request.param} server is not running", srv.log_tail(40))
    return srv


class _FreshServers:
    def __init__(self, registry: _Registry, config: pytest.Config) -> None:
        self._registry = registry
        self._config = config
        self.servers: list[RealLMCacheServer] = []

    def __call__(self, mode: str = "shm", generation: Generation = "0.5.6", **kw: Any) -> RealLMCacheServer:
        python = _venv_python(self._config, generation)
        srv = self._registry.start(mode, python, generation=generation, **kw)
        self.servers.append(srv)
        return srv

    def together(self, *calls: dict[str, Any]) -> list[RealLMCacheServer]:
        """Several servers started at once, one per dict of this factory's arguments
        (``mode``, ``generation``, ``**kw``), returned in that order."""
        return _together([functools.partial(self, **call) for call in calls])


def _together(starts: list[Callable[[], RealLMCacheServer]]) -> list[RealLMCacheServer]:
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    return [f.result() for f in futures]


def _stop_and_list(servers: list[RealLMCacheServer], what: str) -> list[str]:
    """Stop ``servers`` (SIGTERM to all first: they shut down in parallel) and say what
    any of them left: a process or a /dev/shm segment."""
    for srv in servers:
        srv.terminate()
    problems: list[str] = []
    for srv in servers:
        srv.stop()
        problems += [f"{what}: {srv!r}: {p}" for p in srv.leftovers()]
    return problems


@pytest.fixture
def fresh_real_server(
    _real_server_registry: _Registry,
    lmcache_python: Path,
    pytestconfig: pytest.Config,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., RealLMCacheServer]]:
    """Factory ``make(mode="shm", generation="0.5.6", **kw)`` for servers owned by one test."""
    factory = _FreshServers(_real_server_registry, pytestconfig)
    yield factory
    _real_server_registry.stop_later(factory.servers, f"fresh server of {request.node.nodeid}")


@pytest.fixture(scope="module")
def module_real_server(
    request: pytest.FixtureRequest,
    _real_server_registry: _Registry,
    lmcache_python: Path,
    pytestconfig: pytest.Config,
) -> Iterator[RealLMCacheServer]:
    """A server of the module's own, shared by the module's tests that ask for the same
    one: parametrize it indirectly with the ``fresh_real_server`` arguments as a dict
    (``{"mode": "shm", "generation": "0.5.7"}``). pytest runs the tests of one parameter
    together, so one such server is alive at a time. For tests that need a server no other
    module uses (they clear it, count its sessions) but not one each. Stopped after its
    last test, and checked, by the registry's reaper (``_Registry.stop_later``)."""
    factory = _FreshServers(_real_server_registry, pytestconfig)
    srv = factory(**request.param)
    yield srv
    _real_server_registry.stop_later(factory.servers, f"module server of {request.node.nodeid}")


@pytest.fixture(autouse=True)
def _real_server_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print the logs of the real servers a failed test used (teardown output)."""
    yield
    node = request.node
    if not isinstance(node, pytest.Item) or not _test_failed(node):
        return
    servers: list[RealLMCacheServer] = []
    for value in getattr(node, "funcargs", {}).values():
        if isinstance(value, RealLMCacheServer):
            candidates = [value]
        elif isinstance(value, _FreshServers):
            candidates = value.servers
        else:
            continue
        servers += [s for s in candidates if s not in servers]
    _print_log_tails(node, servers)
