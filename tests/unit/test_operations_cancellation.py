"""Cancel every operation at each of its RPCs in turn, on both transports and both server
generations, and check the engine is left clean: no session, prefetch job, read lock,
pending SHM transfer or write reservation.

The operations (:mod:`lmcache_async._engine.ops`) run over a channel that hands each
request straight to the embedded server's in-process engine
(:class:`lmcache_async.testing.InProcessServer`): no sockets, milliseconds per case. The
caller is cancelled as its k-th request is sent (k = 1 .. the number of requests of an
uncancelled run); the operation, now abandoned, must finish the server side on its own.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
import torch

from lmcache_async._engine.compose import KVPart, plan, slot_filler
from lmcache_async._engine.ops import Operations, Registration, RemapResult
from lmcache_async._engine.ops.calls import CALLS, ComposeCall, LookupCall, RemapCall, RetrieveCall, StoreCall
from lmcache_async._engine.runner import OpState, run_detached
from lmcache_async._protocol.wire import (
    GEN_0_5_6,
    GEN_0_5_7,
    Op,
    WireGeneration,
)
from lmcache_async._transport.shm import ShmPool
from lmcache_async.errors import LMCacheTimeoutError
from lmcache_async.rope import RopeSpec
from lmcache_async.testing import InProcessServer, NoReply
from tests.helpers import SMALL_GEOMETRY

pytestmark = pytest.mark.anyio

CS = 16
N_TOKENS = 3 * CS + 5  # three whole chunks and a tail
GENERATIONS = {"0.5.6": GEN_0_5_6, "0.5.7": GEN_0_5_7}


class InProcessChannel:
    """The operations' :class:`~lmcache_async._engine.ops.Channel` over an in-process
    engine; cancels ``victim`` when request number ``cancel_at`` is sent."""

    def __init__(self, srv: InProcessServer, wire: WireGeneration) -> None:
        self.srv = srv
        self.wire = wire
        self.sent: list[Op] = []
        self.silences: list[NoReply] = []
        self.cancel_at: int | None = None
        self.victim: asyncio.Task[Any] | None = None

    @property
    def usable(self) -> bool:
        return True

    async def call(self, opcode: Op, args: Sequence[Any], timeout: float | None) -> Any:
        self.sent.append(opcode)
        if len(self.sent) == self.cancel_at and self.victim is not None:
            self.victim.cancel()  # the caller leaves while this request is in flight
        try:
            return await self.srv.handle(opcode, list(self.wire.request_args(opcode, args)))
        except NoReply as exc:  # the real server would answer nothing: a timeout
            self.silences.append(exc)
            raise LMCacheTimeoutError(opcode.name.lower(), 0.0) from exc


class Harness:
    def __init__(self, srv: InProcessServer, wire: WireGeneration, fifo_cpu: bool) -> None:
        self.srv = srv
        self.wire = wire
        self.fifo_cpu = fifo_cpu
        self.channel = InProcessChannel(srv, wire)
        self.pool: ShmPool | None = None
        self.reg: Registration | None = None
        self.tasks: list[asyncio.Task[Any]] = []
        self._base = int.from_bytes(os.urandom(2), "little") * 10_000

    async def register(self) -> None:
        made = await self.srv.register(SMALL_GEOMETRY)
        if made.shm_name:
            self.pool = ShmPool(made.shm_name, made.pool_size)
        self.reg = Registration(
            model_name=made.model_name,
            geometry=made.geometry,
            chunk_size=made.chunk_size,
            wire=self.wire,
            instance_id=made.instance_id,
            pool=self.pool,
            server_has_shm=bool(made.shm_name),
            fifo_cpu=self.fifo_cpu,
        )

    def ops(self) -> Operations:
        assert self.reg is not None
        return Operations(self.channel, self.reg, cleanup_grace=2.0)

    def tokens(self) -> list[int]:
        self._base += 1000
        return list(range(self._base, self._base + N_TOKENS))

    async def run(self, body: Callable[[Operations, OpState], Awaitable[Any]], cancel_at: int | None) -> Any:
        """Run ``body`` as the client does (a detached task under the caller's wait);
        with ``cancel_at``, cancel the caller at that request, then wait for the
        abandoned operation to finish. Returns the result, or the CancelledError."""
        self.channel.sent.clear()
        self.channel.cancel_at = cancel_at
        self.tasks.clear()
        ops = self.ops()
        caller = asyncio.ensure_future(
            run_detached("op", None, 2.0, lambda op: body(ops, op), self.tasks.append)
        )
        self.channel.victim = caller
        try:
            result: Any = await caller
        except asyncio.CancelledError:
            if not caller.cancelled():
                raise
            result = asyncio.CancelledError()
        await asyncio.wait(self.tasks, timeout=10)  # the abandoned operation's cleanup
        assert all(t.done() for t in self.tasks), "an abandoned operation did not finish"
        for t in self.tasks:
            if not t.cancelled() and t.exception() is not None:
                raise AssertionError(f"the abandoned operation failed: {t.exception()!r}")
        self.channel.victim = None
        return result

    def kv(self) -> torch.Tensor:
        return torch.randn(SMALL_GEOMETRY.kv_shape(N_TOKENS)).to(SMALL_GEOMETRY.dtype)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.srv.close()


@pytest.fixture(params=list(itertools.product(["shm", "pickle"], ["0.5.6", "0.5.7"], [True, False])))
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    mode, generation, fifo_cpu = request.param
    # (without shm_name, an SHM-mode InProcessServer has no segment to map)
    name = f"lmca_cancel_{os.getpid()}_{secrets.token_hex(4)}" if mode == "shm" else None
    srv = InProcessServer(chunk_size=CS, mode=mode, generation=generation, size_bytes=16 << 20, shm_name=name)
    h = Harness(srv, GENERATIONS[generation], fifo_cpu)
    try:
        await h.register()
        assert (h.pool is not None) == (mode == "shm")
        yield h
    finally:
        h.close()
    assert not [f for f in os.listdir("/dev/shm") if name and name in f]


END = N_TOKENS // CS * CS


async def _store(h: Harness, toks: list[int], kv: torch.Tensor) -> None:
    assert await h.run(lambda ops, op: ops.store(op, kv, toks, END, ""), None) is True
    assert h.srv.leftovers().is_clean()


def _compose(h: Harness, toks: list[int], kv: torch.Tensor) -> ComposeCall:
    """The in-pool composition of two parts of one source, the first moved (keys rotated)."""
    rope = RopeSpec(head_dim=SMALL_GEOMETRY.head_dim, theta=10000.0)
    target = h.tokens()
    the_plan = plan(target, [KVPart(toks, CS, 2 * CS), KVPart(toks, 0, 2 * CS)], rope, "", SMALL_GEOMETRY, CS)
    reads = the_plan.reads()
    sources = [(list(src[:n]), n, salt) for (src, salt), n in reads.items()]
    fill = slot_filler(the_plan, SMALL_GEOMETRY, CS, {key: i for i, key in enumerate(reads)})
    return ComposeCall(sources, target[:END], END, "", fill)


#: Each call class (:data:`lmcache_async._engine.ops.calls.CALLS`, one per operation sequence)
#: and its samples: the calls each case runs, given the harness, a stored prompt and its KV.
Sample = Callable[[Harness, list[int], torch.Tensor], Any]
SAMPLES: dict[type[Any], dict[str, Sample]] = {
    LookupCall: {"lookup": lambda h, toks, kv: LookupCall(toks)},
    RetrieveCall: {
        "retrieve": lambda h, toks, kv: RetrieveCall(toks),
        "retrieve-into-out": lambda h, toks, kv: RetrieveCall(toks, out=torch.zeros_like(kv)),
    },
    StoreCall: {
        "store": lambda h, toks, kv: StoreCall(kv, h.tokens()),
        "store-partly-cached": lambda h, toks, kv: StoreCall(
            torch.cat([kv, kv[:, :, :CS]], dim=2), [*toks, *range(7, 7 + CS)]
        ),
    },
    RemapCall: {"remap": lambda h, toks, kv: RemapCall(toks, h.tokens())},
    ComposeCall: {"compose-in-pool": _compose},
}
CASES: dict[str, Sample] = {name: make for cls in CALLS for name, make in SAMPLES.get(cls, {}).items()}


def test_every_call_class_has_a_sample() -> None:
    """A new operation sequence (its call class in ``CALLS``) cannot skip the matrix below."""
    assert [cls.__name__ for cls in CALLS if not SAMPLES.get(cls)] == []
    assert set(SAMPLES) == set(CALLS)


@pytest.mark.parametrize("case", list(CASES))
async def test_cancel_at_every_rpc_leaves_the_engine_clean(harness: Harness, case: str) -> None:
    h = harness
    if case in ("remap", "compose-in-pool") and h.pool is None:
        pytest.skip("an in-pool sequence is SHM only (inline: retrieve + store)")
    # One uncancelled run counts the requests (and checks the result).
    toks, kv = h.tokens(), h.kv()
    await _store(h, toks, kv)
    result = await h.run(CASES[case](h, toks, kv).run, None)
    if case == "lookup":
        assert result == END
    elif case.startswith("retrieve"):
        assert result is not None and torch.equal(result, kv[:, :, :END])
    elif case.startswith("store"):
        assert result is True
    elif case == "compose-in-pool":
        assert result == ([2 * CS], True)  # the source read as far as its parts reach; stored
    else:
        assert result == RemapResult(END, END, True)
    n_requests = len(h.channel.sent)
    assert n_requests >= 2 and h.srv.leftovers().is_clean()
    for k in range(1, n_requests + 1):
        toks, kv = h.tokens(), h.kv()
        await _store(h, toks, kv)
        result = await h.run(CASES[case](h, toks, kv).run, cancel_at=k)
        assert isinstance(result, asyncio.CancelledError), f"request {k} of {n_requests}: not cancelled"
        left = h.srv.leftovers()
        assert left.is_clean(), f"{case}: cancelled at request {k} ({h.channel.sent[k - 1].name}): {left}"
    assert h.channel.silences == []  # every request was one the server answers
