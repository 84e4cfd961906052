"""The blocking facade :class:`lmcache_async.sync_client.Client`.

Parity with AsyncClient (names, signatures, properties), bitwise round trips against the
real server over SHM and pickle, 8 threads at once, calls inside ``asyncio.run``, the
loop-thread deadlock guard, KeyboardInterrupt (real server paused with SIGSTOP: the call
really is in flight, and after SIGCONT no server session is left), fork, one loop thread
across repeated create/close, idle exit, and the ResourceWarning of a dropped client (in
a subprocess). No wall-clock assertions; every wait has a deadline.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import inspect
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from harness.real_server import REPO_ROOT, RealLMCacheServer
from lmcache_async import (
    AsyncClient,
    ClientClosedError,
    DefaultType,
    KVGeometry,
    LMCacheError,
    LMCacheTimeoutError,
    RemapResult,
    connect,
)
from lmcache_async._blocking import loop_thread as _loop_thread
from lmcache_async.client import ClientOptions
from lmcache_async.errors import LoopThreadCallError, SyncUsageError
from lmcache_async.sync_client import _FACADE, LOOP_THREAD_NAME, Client
from tests.helpers import peek, shared_loop_thread
from tools import gen_sync_client

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)
MODEL = f"test-sync-client-{os.getpid()}"
CS = 16  # chunk size of the session servers

_rng = random.Random()


def _tokens(n: int) -> list[int]:
    """Fresh random token ids: no collision with other tests on the shared servers."""
    return [_rng.randrange(1 << 31) for _ in range(n)]


def _kv(n: int) -> torch.Tensor:
    return torch.randn(GEOM.kv_shape(n)).to(GEOM.dtype)


def _client(srv: RealLMCacheServer, **kw: Any) -> Client:
    return Client(srv.url, srv.http_url, MODEL, geometry=GEOM, **kw)


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == LOOP_THREAD_NAME and t.is_alive()]


def _wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _in_flight(client: Client) -> int:
    """Operations running (test-only peek at the async client): their tasks, not the
    cleanup replies (``end_session`` and the like) awaited in the background."""
    return sum(isinstance(t, asyncio.Task) for t in list(peek(client).in_flight_ops))


def _cleanups_pending(client: Client) -> int:
    return len(peek(client).in_flight_ops)  # operations and background cleanup replies


@contextlib.contextmanager
def _interrupt_main_when(cond: Callable[[], bool], timeout: float = 20.0) -> Iterator[None]:
    """Deliver a KeyboardInterrupt to the main thread as soon as ``cond()`` holds."""
    stop = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < deadline:
            if cond():
                _thread.interrupt_main()
                return
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, name="test-interrupter", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join(timeout + 1)


@contextlib.contextmanager
def _paused(srv: RealLMCacheServer) -> Iterator[None]:
    """SIGSTOP the server process (its ZMQ and HTTP endpoints stop answering)."""
    pid = srv.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_for(lambda: _threads_stopped(pid), 10, f"every thread of server {pid} to stop")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _thread_states(pid: int) -> dict[int, str]:
    """Each thread's scheduler state letter (``T``: stopped), from /proc."""
    states: dict[int, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{tid}/stat") as f:
            states[int(tid)] = f.read().rsplit(")", 1)[1].split()[0]
    return states


def _threads_stopped(pid: int) -> bool:
    """SIGSTOP takes effect per thread, after ``kill`` returns: all of them stopped."""
    return all(state in "tT" for state in _thread_states(pid).values())


# --------------------------------------------------------------------------- parity

_SYNC_NAME = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
#: AsyncClient members deliberately without a blocking twin, and why.
_NOT_MIRRORED = {"open": "a Client opens in its constructor (or Client.connect)"}


def _public_members(cls: type) -> dict[str, Any]:
    return {
        name: value
        for name, value in inspect.getmembers_static(cls)
        if not name.startswith("_") or name in _SYNC_NAME
    }


def _params(fn: Any) -> tuple[list[tuple[str, Any, Any, Any]], Any]:
    """Parameters (name, kind, default, annotation text) and return annotation text.

    Annotations are compared as written (both modules use postponed annotations, and
    some names exist only under TYPE_CHECKING), so a twin must spell them the same.
    """
    sig = inspect.signature(fn)
    params = [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]
    ret = sig.return_annotation
    for stream in ("AsyncIterator[", "AsyncGenerator["):  # an async iterator's twin is an Iterator
        if isinstance(ret, str) and ret.startswith(stream):
            ret = "Iterator[" + ret[len(stream) :]
    return params, ("Client" if ret == "AsyncClient" else ret)


def _parity_problems(async_cls: type, sync_cls: type) -> list[str]:
    problems: list[str] = []
    sync_members = dict(inspect.getmembers_static(sync_cls))
    for name, member in _public_members(async_cls).items():
        if name in _NOT_MIRRORED:
            continue
        sync_name = _SYNC_NAME.get(name, name)
        twin = sync_members.get(sync_name)
        if twin is None:
            problems.append(f"{sync_cls.__name__}.{sync_name} is missing (twin of {name})")
            continue
        if isinstance(member, property):
            if not isinstance(twin, property):
                problems.append(f"{sync_cls.__name__}.{sync_name} is not a property")
            else:
                want = inspect.signature(member.fget).return_annotation  # type: ignore[arg-type]
                got = inspect.signature(twin.fget).return_annotation  # type: ignore[arg-type]
                if want != got:
                    problems.append(f"property {sync_name}: {got} != {want}")
            continue
        if not callable(member):
            continue
        if inspect.iscoroutinefunction(twin):
            problems.append(f"{sync_cls.__name__}.{sync_name} is a coroutine function")
        if _params(member) != _params(twin):
            problems.append(
                f"{sync_cls.__name__}.{sync_name}{inspect.signature(twin)} != "
                f"{async_cls.__name__}.{name}{inspect.signature(member)}"
            )
    return problems


def test_every_public_async_member_has_a_blocking_twin_with_the_same_signature() -> None:
    assert _parity_problems(AsyncClient, Client) == []


def test_the_parity_check_catches_a_new_unwrapped_method() -> None:
    class Grown(AsyncClient):
        async def compact(self, tokens: list[int]) -> int:  # a new method, not wrapped
            return 0

        async def noop(self, *, timeout: float | DefaultType | None = 1.0) -> float:  # default differs
            return 0.0

    problems = _parity_problems(Grown, Client)
    assert any("Client.compact is missing" in p for p in problems)
    assert any(".noop(" in p for p in problems)


def test_the_twins_are_what_the_generator_writes() -> None:
    """``_sync_methods.py`` is ``tools/gen_sync_client.py``'s output for the current
    ``AsyncClient`` and ``_FACADE`` (what ``make lint`` checks with ``--check``); every
    row names a public async method."""
    assert gen_sync_client.OUTPUT.read_text() == gen_sync_client.generate()
    assert gen_sync_client.main(["--check"]) == 0
    assert set(_FACADE) <= {
        name
        for name, member in inspect.getmembers_static(AsyncClient)
        if not name.startswith("_")
        and (inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member))  # kv_events
        and name not in ("open", "aclose")
    }


def _grown(method: str, row: str = "_Twin()", imports: str = "") -> tuple[str, str]:
    """client.py with ``method`` added to AsyncClient (and ``imports``), and sync_client.py
    with ``row`` as its _FACADE row (``""``: none)."""
    client = gen_sync_client.CLIENT.read_text()
    assert "\nclass AsyncClient" in client
    client = client.replace("\nclass AsyncClient", f"\n{imports}\n\nclass AsyncClient", 1)
    client = client.replace(
        "    async def noop(", f"{textwrap.indent(textwrap.dedent(method), '    ')}\n    async def noop(", 1
    )
    sync = gen_sync_client.SYNC_CLIENT.read_text()
    if row:
        name = method.split("def ", 1)[1].split("(", 1)[0]
        sync = sync.replace("_FACADE: Final = {", f'_FACADE: Final = {{\n    "{name}": {row},', 1)
    return client, sync


def test_a_method_without_a_row_gets_the_default_twin_and_a_row_without_a_method_is_refused() -> None:
    timed = "async def compact(self, *, timeout: float | None = 1.0) -> int:\n    return 0\n"
    client, sync = _grown(timed, row="")
    assert "    def compact(self, *, timeout: float | None = 1.0) -> int:" in gen_sync_client.generate(
        client, sync
    )
    client, sync = _grown("async def compact(self, tokens: list[int]) -> int:\n    return 0\n", row="")
    with pytest.raises(
        gen_sync_client.GenerationError, match="compact: a bounded twin needs a timeout parameter"
    ):
        gen_sync_client.generate(client, sync)  # the default twin is bounded
    sync = gen_sync_client.SYNC_CLIENT.read_text().replace(
        "_FACADE: Final = {", '_FACADE: Final = {\n    "gone": _Twin(),'
    )
    with pytest.raises(
        gen_sync_client.GenerationError, match="_FACADE rows without an AsyncClient method: gone"
    ):
        gen_sync_client.generate(None, sync)


_TICKS = """
async def ticks(self, n: int, *, timeout: float | DefaultType | None = DEFAULT) -> AsyncIterator[int]:
    \"\"\"Count from 0 to n - 1.\"\"\"
    for i in range(n):
        yield i
"""


def _ticking_client_class(method: str = _TICKS) -> type[Client]:
    """A Client whose generated twins include one of ``method``, an async iterator."""
    client, sync = _grown(
        method, "_Twin(bound=False)", imports="from collections.abc import AsyncIterator  # noqa: E402"
    )
    source = gen_sync_client.generate(client, sync)
    module = types.ModuleType("generated_sync_methods")
    exec(compile(source, "<generated>", "exec"), module.__dict__)
    return type("TickingClient", (module.SyncMethods, Client), {})


def test_an_async_iterator_becomes_a_blocking_iterator_closed_on_break(
    real_server_pickle: RealLMCacheServer,
) -> None:
    """An ``async def ... -> AsyncIterator[T]`` (an async generator, or a coroutine
    returning an async iterator) gets a twin returning ``Iterator[T]``: each step is a
    blocking call on the loop, and leaving the loop early closes the async iterator there
    (its ``finally`` has run when the ``for`` is left)."""
    import collections.abc

    cls = _ticking_client_class()
    assert inspect.signature(cls.ticks).return_annotation == "Iterator[int]"  # type: ignore[attr-defined]
    events: list[str] = []

    async def ticks(
        self: AsyncClient, n: int, *, timeout: float | None = None
    ) -> collections.abc.AsyncIterator[int]:
        assert threading.current_thread().name == LOOP_THREAD_NAME
        try:
            for i in range(n):
                await asyncio.sleep(0)
                yield i
        finally:
            events.append(f"closed after timeout={timeout}")

    srv = real_server_pickle
    with cls(srv.url, srv.http_url, MODEL, geometry=GEOM, timeout=7) as c:
        c._async.ticks = types.MethodType(ticks, c._async)  # type: ignore[attr-defined]
        assert list(c.ticks(3)) == [0, 1, 2]  # type: ignore[attr-defined]
        assert events == ["closed after timeout=7.0"]
        for i in c.ticks(1000):  # type: ignore[attr-defined]
            if i == 2:
                break
        assert events == ["closed after timeout=7.0"] * 2  # closed on the loop when the for was left
        with pytest.raises(ValueError, match="timeout"):
            c.ticks(3, timeout=-1)  # type: ignore[attr-defined]  # checked in the caller's thread, at the call
    with pytest.raises(ClientClosedError):
        c.ticks(3)  # type: ignore[attr-defined]


def test_a_coroutine_returning_an_async_iterator_is_awaited_for_its_iterator() -> None:
    method = """
async def stream(self, n: int) -> AsyncIterator[int]:
    \"\"\"A stream made by a coroutine.\"\"\"
    return self._numbers(n)
"""
    client, sync = _grown(method, "_Twin(bound=False)", imports="from collections.abc import AsyncIterator")
    source = gen_sync_client.generate(client, sync)
    twin = source.split("    def stream(", 1)[1].split("\n\n    def ", 1)[0]
    assert 'return self._iterate("stream", None, lambda: self._async.stream(n))' in twin
    assert "ready(" not in twin and "-> Iterator[int]:" in twin


def test_constructor_and_connect_take_the_async_clients_arguments() -> None:
    """The keywords are written once: ``ClientOptions`` names exactly the async client's
    keyword arguments, with their annotations, and the other three signatures take the
    same positional arguments and ``**options: Unpack[ClientOptions]``."""
    params = _params(AsyncClient.__init__)[0]
    positional = [p for p in params if p[1] is not inspect.Parameter.KEYWORD_ONLY]
    keywords = {
        name: annotation for name, kind, _, annotation in params if kind is inspect.Parameter.KEYWORD_ONLY
    }
    written = {name: getattr(t, "__forward_arg__", t) for name, t in ClientOptions.__annotations__.items()}
    assert written == keywords
    assert ClientOptions.__total__ is False
    options = ("options", inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty, "Unpack[ClientOptions]")
    assert _params(Client.__init__)[0] == [*positional, options]
    assert _params(Client.connect)[0] == [*positional[1:], options]  # classmethod: no self
    assert _params(connect)[0] == [*positional[1:], options]


def test_instance_attributes_are_mirrored() -> None:
    unopened = AsyncClient("tcp://127.0.0.1:9", "http://127.0.0.1:9", "m")  # no I/O yet
    public = {name for name in vars(unopened) if not name.startswith("_")}
    assert public  # url, http_url, model_name, timeout, ...
    assert sorted(n for n in public if not isinstance(getattr(Client, n, None), property)) == []


def test_sync_usage_error_is_a_runtime_error_and_pickles() -> None:
    import pickle

    err = SyncUsageError("boom", "forked")
    assert isinstance(err, LMCacheError) and isinstance(err, RuntimeError)
    back = pickle.loads(pickle.dumps(err))
    assert back.reason == "forked" and str(back) == "boom"


# --------------------------------------------------------------------------- real server


def test_store_retrieve_lookup_remap_bitwise(real_server: RealLMCacheServer) -> None:
    srv = real_server
    n = 3 * CS
    source, target = _tokens(n + 5), _tokens(n)
    kv = _kv(n + 5)
    with _client(srv) as client:
        assert client.transfer == srv.mode
        assert client.chunk_size == CS
        assert client.geometry == GEOM
        assert client.retrieve(source) is None
        assert client.lookup(source) == 0
        assert client.store(kv, source) is True
        assert client.store(kv, source) is False  # every chunk cached already
        got = client.retrieve(source)
        assert got is not None and torch.equal(got, kv[:, :, :n])
        assert client.lookup(source) == n
        out = torch.zeros(GEOM.kv_shape(n + CS), dtype=GEOM.dtype)
        view = client.retrieve(source, out=out)
        assert view is not None and view.data_ptr() == out.data_ptr() and torch.equal(view, kv[:, :, :n])
        result = client.remap(source, target)
        assert result == RemapResult(retrieved_tokens=n, stored_tokens=n, stored_new=True)
        moved = client.retrieve(target)
        assert moved is not None and torch.equal(moved, kv[:, :, :n])
        salted = client.remap(source, target, target_cache_salt="other")
        assert salted.stored_new is True
        assert client.lookup(target, "other") == n
        assert client.noop() > 0
        assert client.status(max_age=0)["chunk_size"] == CS
        assert client.config()["mp"]["chunk_size"] == CS
    assert client.closed


def test_bulk_wrappers_block_and_run_progress_on_the_loop_thread(real_server: RealLMCacheServer) -> None:
    n = 2 * CS
    sources, targets = [_tokens(n) for _ in range(4)], [_tokens(n) for _ in range(4)]
    kvs = [_kv(n) for _ in range(4)]
    progress_threads: set[str] = set()
    with _client(real_server) as client:
        stored = client.store_many(
            list(zip(kvs, sources, strict=True)),
            concurrency=2,
            progress=lambda p: progress_threads.add(threading.current_thread().name),
        )
        assert [r.stored_new for r in stored] == [True] * 4
        assert progress_threads == {LOOP_THREAD_NAME}
        remapped = client.remap_many(list(zip(sources, targets, strict=True)), concurrency=3)
        assert [(r.retrieved_tokens, r.stored_tokens, r.error) for r in remapped] == [(n, n, None)] * 4
        got = client.retrieve_many(targets)
        assert all(r.kv is not None and torch.equal(r.kv, kv) for r, kv in zip(got, kvs, strict=True))


def test_lifecycle_close_is_idempotent_and_use_after_close_fails(real_server_shm: RealLMCacheServer) -> None:
    client = Client.connect(real_server_shm.url, real_server_shm.http_url, MODEL, geometry=GEOM)
    assert not client.closed and "open" in repr(client)
    client.timeout = 5.0
    assert client.timeout == 5.0
    with pytest.raises(ValueError, match="timeout"):
        client.timeout = -1
    client.close()
    client.close()
    assert client.closed
    with pytest.raises(ClientClosedError):
        client.lookup(_tokens(CS))
    with pytest.raises(ClientClosedError), client:
        pass


def test_open_failure_raises_and_releases_the_loop_thread(real_server_shm: RealLMCacheServer) -> None:
    with pytest.raises(ValueError, match="url"):
        Client("not a url", real_server_shm.http_url, MODEL, geometry=GEOM)
    with pytest.raises(TypeError):
        Client(real_server_shm.url, real_server_shm.http_url, MODEL, geometry="big")  # type: ignore[arg-type]
    lt = shared_loop_thread()
    refs = lt.refs if lt is not None else 0
    with pytest.raises(ValueError, match="url"):
        Client("not a url", real_server_shm.http_url, MODEL, geometry=GEOM)
    lt2 = shared_loop_thread()
    assert (lt2.refs if lt2 is not None else 0) == refs


def test_eight_threads_at_once(real_server: RealLMCacheServer) -> None:
    n_threads = 8
    barrier = threading.Barrier(n_threads, timeout=30)
    results: list[tuple[bool, bool, bool, int] | None] = [None] * n_threads
    errors: list[str] = []
    with _client(real_server) as client:

        def work(i: int) -> None:
            try:
                n = CS * (1 + i % 3)
                toks, other = _tokens(n), _tokens(n)
                kv = _kv(n)
                barrier.wait()
                stored = client.store(kv, toks)
                got = client.retrieve(toks)
                moved = client.remap(toks, other)
                back = client.retrieve(other)
                same = got is not None and torch.equal(got, kv)
                same_moved = back is not None and torch.equal(back, kv)
                results[i] = (stored, same, same_moved, moved.stored_tokens - n)
            except BaseException:
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=work, args=(i,), name=f"worker-{i}") for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not [t.name for t in threads if t.is_alive()]
        assert errors == []
        assert results == [(True, True, True, 0)] * n_threads
        assert len(_loop_threads()) == 1


def test_close_from_another_thread_while_calls_are_in_flight(real_server_shm: RealLMCacheServer) -> None:
    toks = _tokens(CS)
    client = _client(real_server_shm)
    client.store(_kv(CS), toks)
    started = threading.Barrier(5, timeout=30)
    outcomes: list[str] = []

    def hammer() -> None:
        started.wait()
        try:
            while True:
                assert client.lookup(toks) == CS
        except ClientClosedError:
            outcomes.append("closed")
        except BaseException as exc:
            outcomes.append(repr(exc))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)  # let them get going (not an assertion)
    client.close()
    for t in threads:
        t.join(30)
    assert not [t for t in threads if t.is_alive()]
    assert outcomes == ["closed"] * 4
    _wait_for(lambda: real_server_shm.status()["active_sessions"] == 0, 20, "the sessions to end")


def test_blocking_calls_inside_asyncio_run(real_server_shm: RealLMCacheServer) -> None:
    toks = _tokens(2 * CS)
    kv = _kv(2 * CS)

    async def main() -> tuple[bool, bool, int]:
        # A loop is running in this thread; the facade's own loop thread does the work.
        with _client(real_server_shm) as client:
            stored = client.store(kv, toks)
            got = client.retrieve(toks)
            return stored, got is not None and torch.equal(got, kv), client.lookup(toks)

    assert asyncio.run(main()) == (True, True, 2 * CS)


@pytest.mark.anyio
async def test_blocking_calls_from_an_async_test(real_server_shm: RealLMCacheServer) -> None:
    toks = _tokens(CS)
    with _client(real_server_shm) as client:
        assert client.store(_kv(CS), toks) is True
        assert client.lookup(toks) == CS
        # and the async client on this loop works next to it
        async with AsyncClient(real_server_shm.url, real_server_shm.http_url, MODEL, geometry=GEOM) as ac:
            assert await ac.lookup(toks) == CS


def test_a_blocking_call_from_the_loop_thread_raises_at_once(real_server_shm: RealLMCacheServer) -> None:
    toks = _tokens(CS)
    with _client(real_server_shm) as client:
        seen: list[BaseException] = []

        async def on_the_loop() -> None:
            for attempt in (
                lambda: client.lookup(toks),
                lambda: client.noop(),
                lambda: client.close(),
                lambda: _client(real_server_shm),
            ):
                try:
                    attempt()
                except BaseException as exc:
                    seen.append(exc)

        fut = asyncio.run_coroutine_threadsafe(on_the_loop(), peek(client).loop_thread.loop)
        fut.result(timeout=30)
        assert [type(e) for e in seen] == [LoopThreadCallError] * 4
        assert all(isinstance(e, SyncUsageError) and e.reason == "loop_thread" for e in seen)
        assert not client.closed
        assert client.lookup(toks) == 0  # unaffected


def test_the_wait_is_bounded_when_the_loop_is_stuck(real_server_shm: RealLMCacheServer) -> None:
    with _client(real_server_shm, cleanup_grace=0.2) as client:
        peek(client).loop_thread.loop.call_soon_threadsafe(time.sleep, 2.0)  # blocks the loop thread
        with pytest.raises(LMCacheTimeoutError) as err:
            client.noop(timeout=0.1)
        assert err.value.operation == "noop"
        assert client.noop(timeout=10) > 0  # the loop came back; the client still works


def test_keyboard_interrupt_cancels_and_leaves_no_server_session(
    fresh_real_server: Callable[..., RealLMCacheServer],
) -> None:
    srv = fresh_real_server("shm")
    n = 4 * CS
    toks = _tokens(n)
    kv = _kv(n)
    with _client(srv, cleanup_grace=10.0) as client:
        assert client.store(kv, toks) is True
        assert client.drain(timeout=10) is True  # the store's end_session, sent in the background
        baseline = srv.status()["active_sessions"]
        calls: list[Callable[[], object]] = [
            lambda: client.lookup(toks, timeout=60),
            lambda: client.retrieve(toks, timeout=60),
        ]
        for call in calls:
            with _paused(srv), _interrupt_main_when(lambda: _in_flight(client) > 0):
                try:
                    got = call()
                except KeyboardInterrupt:
                    pass
                else:
                    states = _thread_states(srv.pid or 0)
                    pytest.fail(f"no KeyboardInterrupt: the call returned {got!r}; server threads {states}")
            # The server runs again: the abandoned operation ends its session on its own.
            _wait_for(lambda: _cleanups_pending(client) == 0, 30, "the abandoned operation to clean up")
            _wait_for(
                lambda: (
                    srv.status()["active_sessions"] == baseline and srv.status()["active_prefetch_jobs"] == 0
                ),
                30,
                "active_sessions to return to the baseline",
            )
        # Locks were released and the client is usable.
        got = client.retrieve(toks)
        assert got is not None and torch.equal(got, kv)
        assert client.store(kv, toks) is False


def test_keyboard_interrupt_during_connect_closes_what_was_opened(
    fresh_real_server: Callable[..., RealLMCacheServer],
) -> None:
    srv = fresh_real_server("pickle")
    before = _loop_threads()
    lt = shared_loop_thread()
    refs = lt.refs if lt is not None and lt.alive() else 0
    armed = threading.Event()
    timer = threading.Timer(0.3, armed.set)  # by then the constructor waits on /config
    with _paused(srv), _interrupt_main_when(armed.is_set), pytest.raises(KeyboardInterrupt):
        _start_then_open(timer, srv)
    timer.join(5)
    lt = shared_loop_thread()
    assert (lt.refs if lt is not None and lt.alive() else 0) == refs
    assert len(_loop_threads()) <= max(1, len(before))
    _wait_for(lambda: srv.status()["registered_non_cuda_instance_ids"] == [], 20, "no registration")
    with _client(srv) as client:  # and a client opens fine afterwards
        assert client.lookup(_tokens(CS)) == 0


def _start_then_open(timer: threading.Timer, srv: RealLMCacheServer) -> None:
    timer.start()
    _client(srv)


def test_repeated_create_and_close_keeps_one_loop_thread(real_server: RealLMCacheServer) -> None:
    toks = _tokens(CS)
    idents = set()
    for _ in range(5):
        with _client(real_server) as client:
            client.lookup(toks)
            threads = _loop_threads()
            assert len(threads) == 1
            idents.add(threads[0].ident)
    with _client(real_server) as a, _client(real_server) as b:
        assert peek(a).loop_thread is peek(b).loop_thread
        assert len(_loop_threads()) == 1
    assert len(idents) == 1  # reused, not restarted
    assert len(_loop_threads()) <= 1


def test_the_idle_loop_thread_exits_and_a_new_one_starts(
    real_server_shm: RealLMCacheServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    current = shared_loop_thread()
    if current is not None and current.alive() and current.refs:
        pytest.skip("another test of this process holds an open Client")
    monkeypatch.setattr(_loop_thread, "IDLE_LINGER", 0.0)
    with _client(real_server_shm) as client:
        first = peek(client).loop_thread
    _wait_for(lambda: not first.thread.is_alive(), 20, "the idle loop thread to exit")
    assert _loop_threads() == []
    with _client(real_server_shm) as client:
        assert peek(client).loop_thread is not first
        assert client.lookup(_tokens(CS)) == 0
        assert len(_loop_threads()) == 1


def test_fork_inherited_client_refuses_and_a_new_one_works(real_server_shm: RealLMCacheServer) -> None:
    srv = real_server_shm
    toks = _tokens(2 * CS)
    with _client(srv) as client:
        assert client.store(_kv(2 * CS), toks) is True
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 99
            try:
                os.close(read_fd)
                code = _forked_child(client, srv, toks, write_fd)
            except BaseException:
                os.write(write_fd, traceback.format_exc().encode())
                code = 98
            finally:
                os._exit(code)
        os.close(write_fd)
        deadline = time.monotonic() + 60
        status = None
        while status is None:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = raw
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child did not finish within 60 s")
            else:
                time.sleep(0.02)
        with os.fdopen(read_fd, "rb") as pipe:
            message = pipe.read().decode(errors="replace")
        assert os.waitstatus_to_exitcode(status) == 0, message
        assert client.lookup(toks) == 2 * CS  # the parent's client is untouched


def _forked_child(client: Client, srv: RealLMCacheServer, toks: list[int], out: int) -> int:
    def say(msg: str) -> None:
        os.write(out, msg.encode() + b"\n")

    try:
        client.lookup(toks)
    except SyncUsageError as exc:
        if exc.reason != "forked" or "fork" not in str(exc):
            say(f"wrong error: {exc!r}")
            return 11
    else:
        say("the inherited client did not refuse")
        return 10
    client.close()  # a no-op in the child
    if _loop_threads():
        say(f"loop threads in the child: {_loop_threads()}")
        return 12
    with _client(srv) as fresh:
        hit = fresh.lookup(toks)
        if hit != 2 * CS:
            say(f"the new client saw {hit} tokens")
            return 13
        if len(_loop_threads()) != 1:
            say("not exactly one loop thread in the child")
            return 14
    return 0


_DROPPED_SCRIPT = textwrap.dedent(
    """
    import gc, sys
    import torch
    from lmcache_async import KVGeometry
    from lmcache_async.sync_client import Client

    url, http_url, model = sys.argv[1:4]
    geom = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=16)
    dropped = Client(url, http_url, model, geometry=geom)
    print("dropped", dropped.instance_id, flush=True)
    del dropped
    gc.collect()  # finalized now: closed in the background
    kept = Client(url, http_url, model, geometry=geom)
    kept.lookup([1] * 16)
    print("kept", kept.instance_id, flush=True)
    # exit with `kept` still open: closed by the exit hook
    """
)


def test_a_dropped_client_is_closed_with_a_resource_warning(real_server_pickle: RealLMCacheServer) -> None:
    srv = real_server_pickle
    argv = [sys.executable, "-W", "always::ResourceWarning", "-c", _DROPPED_SCRIPT]
    proc = subprocess.run(
        [*argv, srv.url, srv.http_url, MODEL],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=str(REPO_ROOT),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    ids = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.splitlines()}
    assert set(ids) == {"dropped", "kept"}
    assert proc.stderr.count("ResourceWarning") == 2, proc.stderr
    assert proc.stderr.count("was never closed") == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    registered = srv.status()["registered_non_cuda_instance_ids"]
    assert ids["dropped"] not in registered and ids["kept"] not in registered


def test_a_caller_is_woken_when_the_loop_thread_blocks_not_inside_the_iteration() -> None:
    # The caller of a finished call is woken right before the loop thread blocks in
    # select (and drops the GIL), not from inside the callback that finished it: woken
    # there, it would find the GIL held for the rest of the iteration and sleep again.
    lt = _loop_thread.LoopThread.acquire()
    try:
        seen: list[tuple[bool, bool]] = []
        gate = threading.Event()
        submitted = threading.Event()

        async def body() -> int:
            while not submitted.is_set():  # until the test holds the call (below)
                await asyncio.sleep(0.001)
            return 7

        def observe(call: _loop_thread.LoopCall[int]) -> None:  # on the loop thread
            # Same iteration as the finish: finished, caller not yet woken.
            seen.append((call._finished, call.done.is_set()))
            gate.set()

        holder: list[_loop_thread.LoopCall[int]] = []
        call = lt.submit(body, on_done=lambda: observe(holder[0]))
        holder.append(call)
        submitted.set()
        assert call.wait("t", 5.0, 1.0) == 7
        assert gate.is_set() and seen == [(True, False)]
        assert call.done.is_set()
    finally:
        lt.release()


def test_a_call_finished_in_the_loops_last_iteration_still_wakes_its_caller() -> None:
    lt = _loop_thread.LoopThread()
    lt.refs = 1

    async def body() -> str:
        lt.loop.stop()  # the loop's last iteration: no select after it
        return "done"

    call = lt.submit(body)
    assert call.done.wait(5.0)
    assert call.outcome() == "done"
    lt.thread.join(5.0)
    assert not lt.thread.is_alive()


def test_the_done_flag_wakes_every_waiter_and_times_out_unset() -> None:
    done = _loop_thread.Done()
    assert not done.is_set()
    t0 = time.monotonic()
    assert done.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.04
    assert done.wait(0) is False
    woken: list[bool] = []
    waiters = [threading.Thread(target=lambda: woken.append(done.wait(5.0))) for _ in range(3)]
    for w in waiters:
        w.start()
    done.set()
    done.set()  # idempotent
    for w in waiters:
        w.join(5.0)
    assert woken == [True, True, True] and done.is_set()
    assert done.wait(None) is True and done.wait(0) is True
