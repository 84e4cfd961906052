"""Soak: thousands of mixed operations with random cancellations and deadlines on ONE
AsyncClient against the REAL LMCache server, then proof that nothing was left behind.

Operations: store, retrieve, lookup, remap, and the bulk ``store_many`` / ``remap_many``
(each bulk item counts as one operation), run 16 at a time; about one in six is
cancelled after a random number of event-loop turns and one in six gets a deadline of
0.2-20 ms. A model of what was stored checks every read that succeeds:

- each token list always carries the same KV (a prompt its own seeded KV; an alias, which
  is only ever the target of ``remap`` from one fixed prompt, that prompt's KV), so any
  prefix a retrieve returns must equal the model's KV bitwise;
- once a store (or remap) of a list returned, the whole aligned list is cached (the 1 GiB
  L1 never evicts this little), so a later retrieve/lookup must hit all of it.

Afterwards (what the server exposes on both generations): the client's pending table
and its table of operations are empty; ``/status``'s ``active_sessions`` and
``active_prefetch_jobs`` are back at their baseline; no read lock is left (a non-forced
``clear`` evicts every object: each lookup then answers 0); every prompt is storable
again and reads back bitwise; the client's RSS grew by less than ``RSS_BOUND`` after
the warm-up.

Each generation and transport has a server of this module's own (``module_real_server``: no
other module's client is counted in its sessions, and the final ``clear`` evicts only what
the soaks stored); its short and its long soak run one after the other on it, each with its
own model and prompts, each from the baseline it measures.

CI (``make test``) runs both: the short versions (1,000 operations on 0.5.6 SHM, 300 on the
others) and the long ones (10,000 on 0.5.6 SHM, 2,000 on 0.5.6 inline and 0.5.7 SHM, 1,000 on
0.5.7 inline). ``pytest -m slow tests/system/test_soak.py`` runs only the long ones;
``-m "not slow"`` leaves them out.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import lmcache_async as lmc
from lmcache_async import AsyncClient
from lmcache_async._protocol.wire import Op
from tests.helpers import SMALL_GEOMETRY, fresh_tokens, peek, random_kv, unique_model

pytestmark = pytest.mark.anyio

CS = 16
PROMPTS = 24
RSS_BOUND = 64 << 20  # bytes of client RSS growth allowed after the warm-up
CONCURRENCY = 16


def rss() -> int:
    """The process's anonymous resident memory (RssAnon): the mapped SHM pool's pages,
    which the client touches as it copies KV in and out, are not the client's growth."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@dataclass
class Model:
    """What each token list carries, and which lists are known to be cached in full."""

    kv: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    complete: set[tuple[int, ...]] = field(default_factory=set)
    reads_checked: int = 0
    hits_checked: int = 0

    def check_read(self, tokens: list[int], got: torch.Tensor | None, was_complete: bool) -> None:
        """``was_complete``: the list was stored in full before the read was sent."""
        key = tuple(tokens)
        full = len(tokens) // CS * CS
        if got is None:
            assert not was_complete, f"a retrieve missed a list stored in full ({len(tokens)} tokens)"
            return
        n = got.shape[2]
        assert n % CS == 0 and 0 < n <= full
        if was_complete:
            assert n == full, f"a retrieve hit {n} of {full} tokens of a list stored in full"
        assert torch.equal(got, self.kv[key][:, :, :n]), "a retrieve returned KV other than what was stored"
        self.reads_checked += 1
        self.hits_checked += n // CS

    def check_lookup(self, tokens: list[int], hit: int, was_complete: bool) -> None:
        full = len(tokens) // CS * CS
        assert 0 <= hit <= full and hit % CS == 0
        if was_complete:
            assert hit == full


@dataclass
class Tally:
    ok: int = 0
    cancelled: int = 0
    timed_out: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


async def soak(c: AsyncClient, n_ops: int, seed: int) -> tuple[Model, Tally, int, int]:
    rng = random.Random(seed)
    model = Model()
    prompts: list[list[int]] = []
    aliases: list[list[int]] = []
    for i in range(PROMPTS):
        p = fresh_tokens(rng.randint(1, 4) * CS + rng.randint(0, CS - 1))
        prompts.append(p)
        model.kv[tuple(p)] = random_kv(SMALL_GEOMETRY, len(p), seed=seed * 1000 + i)
        a = fresh_tokens(len(p))
        aliases.append(a)
        model.kv[tuple(a)] = model.kv[tuple(p)]
    tally = Tally()

    def pick() -> int:
        return rng.randrange(PROMPTS)

    def make_op() -> tuple[str, Callable[[float | None], Coroutine[Any, Any, None]], int]:
        """(name, coroutine factory taking a timeout, the number of operations it counts)."""
        kind = rng.choices(
            ["store", "retrieve", "lookup", "remap", "retrieve_alias", "store_many", "remap_many"],
            weights=[20, 30, 15, 12, 10, 6, 7],
        )[0]
        i = pick()
        p, a = prompts[i], aliases[i]
        kv = model.kv[tuple(p)]

        if kind == "store":

            async def run_store(timeout: float | None) -> None:
                assert await c.store(kv, p, timeout=timeout) in (True, False)
                model.complete.add(tuple(p))

            return kind, run_store, 1
        if kind in ("retrieve", "retrieve_alias"):
            toks = p if kind == "retrieve" else a
            cut = rng.choice([len(toks), len(toks) - rng.randint(0, len(toks) - 1)])
            sub = toks[:cut]

            async def run_retrieve(timeout: float | None) -> None:
                was_complete = tuple(toks) in model.complete
                got = await c.retrieve(sub, timeout=timeout)
                if tuple(sub) == tuple(toks):
                    model.check_read(toks, got, was_complete)
                elif got is not None:
                    assert torch.equal(got, model.kv[tuple(toks)][:, :, : got.shape[2]])
                    model.reads_checked += 1

            return "retrieve", run_retrieve, 1
        if kind == "lookup":

            async def run_lookup(timeout: float | None) -> None:
                was_complete = tuple(p) in model.complete
                model.check_lookup(p, await c.lookup(p, timeout=timeout), was_complete)

            return kind, run_lookup, 1
        if kind == "remap":

            async def run_remap(timeout: float | None) -> None:
                was_complete = tuple(p) in model.complete
                res = await c.remap(p, a, timeout=timeout)
                assert res.stored_tokens == res.retrieved_tokens
                if was_complete:
                    assert res.retrieved_tokens == len(p) // CS * CS
                if res.retrieved_tokens == len(a) // CS * CS and res.retrieved_tokens:
                    model.complete.add(tuple(a))

            return kind, run_remap, 1
        idx = [pick() for _ in range(4)]
        if kind == "store_many":
            items = [(model.kv[tuple(prompts[j])], prompts[j]) for j in idx]

            async def run_store_many(timeout: float | None) -> None:
                res = await c.store_many(items, concurrency=2, timeout=timeout)
                for j, r in zip(idx, res, strict=True):
                    if r.error is None:
                        model.complete.add(tuple(prompts[j]))
                    elif not isinstance(r.error, TimeoutError | asyncio.CancelledError):
                        raise r.error

            return kind, run_store_many, 4
        pairs = [(prompts[j], aliases[j]) for j in idx]

        async def run_remap_many(timeout: float | None) -> None:
            res = await c.remap_many(pairs, concurrency=2, timeout=timeout)
            for j, r in zip(idx, res, strict=True):
                if r.error is None:
                    if r.retrieved_tokens == len(aliases[j]) // CS * CS and r.retrieved_tokens:
                        model.complete.add(tuple(aliases[j]))
                elif not isinstance(r.error, TimeoutError | asyncio.CancelledError):
                    raise r.error

        return kind, run_remap_many, 4

    done = 0
    warm_rss = 0
    while done < n_ops:
        batch: list[tuple[str, asyncio.Task[None], int | None]] = []
        while len(batch) < CONCURRENCY and done < n_ops:
            name, run, weight = make_op()
            fate = rng.random()
            timeout = rng.uniform(0.0002, 0.02) if fate < 1 / 6 else None
            cancel_after = rng.randint(0, 12) if 1 / 6 <= fate < 2 / 6 else None
            batch.append((name, asyncio.create_task(run(timeout)), cancel_after))
            done += weight
        for turn in range(13):
            for _, task, cancel_after in batch:
                if cancel_after == turn:
                    task.cancel()
            await asyncio.sleep(0)
        for name, task, _ in batch:
            try:
                await task
            except asyncio.CancelledError:
                tally.cancelled += 1
            except lmc.LMCacheTimeoutError:
                tally.timed_out += 1
            else:
                tally.ok += 1
                tally.by_op[name] = tally.by_op.get(name, 0) + 1
        if not warm_rss and done >= n_ops // 10:
            warm_rss = rss()
    return model, tally, warm_rss, rss()


async def wait_for_baseline(
    c: AsyncClient, baseline: tuple[int, int], deadline: float = 60.0
) -> tuple[int, int]:
    """Wait until the client's abandoned operations finished their cleanup, then until
    ``/status`` shows the baseline sessions and prefetch jobs (or the deadline)."""
    end = time.monotonic() + deadline
    while peek(c).in_flight_ops and time.monotonic() < end:
        await asyncio.sleep(0.05)
    while True:
        st = await c.status(max_age=0)
        now = (st["active_sessions"], st["active_prefetch_jobs"])
        if now == baseline or time.monotonic() > end:
            return now
        await asyncio.sleep(0.05)


async def run_soak(srv: Any, n_ops: int, seed: int) -> None:
    async with AsyncClient(
        srv.url, srv.http_url, unique_model("soak"), geometry=SMALL_GEOMETRY, timeout=30
    ) as c:
        st = await c.status(max_age=0)
        baseline = (st["active_sessions"], st["active_prefetch_jobs"])
        model, tally, warm_rss, end_rss = await soak(c, n_ops, seed)
        print(f"soak {srv.generation}/{srv.mode} n={n_ops}: {tally}, reads checked {model.reads_checked} "
              f"({model.hits_checked} chunks), RSS {warm_rss >> 20} -> {end_rss >> 20} MiB")  # fmt: skip
        assert tally.ok > n_ops // 3 and tally.cancelled > 0 and model.reads_checked > 0

        # Nothing pending, no operation still cleaning up, server sessions and jobs at baseline.
        assert await wait_for_baseline(c, baseline) == baseline
        assert len(peek(c).in_flight_ops) == 0
        assert peek(c).conn.in_flight == 0
        assert end_rss - warm_rss < RSS_BOUND, f"client RSS grew by {(end_rss - warm_rss) >> 20} MiB"

        # Every list the model says is complete reads back in full, bitwise.
        for key in sorted(model.complete):
            model.check_read(list(key), await c.retrieve(list(key)), True)

        # No read lock left: a non-forced clear evicts every object.
        await peek(c).conn.call(Op.CLEAR, (False,), timeout=30)
        for key in model.kv:
            assert await c.lookup(list(key)) == 0
        # Everything is storable again (no reservation left behind) and reads back bitwise.
        model.complete.clear()
        for key, kv in model.kv.items():
            assert await c.store(kv, list(key)) is True
            model.complete.add(key)
            model.check_read(list(key), await c.retrieve(list(key)), True)
        assert await wait_for_baseline(c, baseline) == baseline
        assert peek(c).conn.in_flight == 0


#: The module's servers (``module_real_server``'s arguments): the short and the long soak
#: of one server run one after the other on it, then it is stopped.
SERVERS = [
    pytest.param({"generation": g, "mode": m}, id=f"{g.replace('.', '')[:3]}-{m}")
    for g, m in (("0.5.6", "shm"), ("0.5.6", "pickle"), ("0.5.7", "shm"), ("0.5.7", "pickle"))
]
#: Operations per soak, by server: the short run and the long one (``-m slow``; CI runs both).
SHORT = {("0.5.6", "shm"): 1000, ("0.5.6", "pickle"): 300, ("0.5.7", "shm"): 300, ("0.5.7", "pickle"): 300}
LONG = {
    ("0.5.6", "shm"): 10_000,
    ("0.5.6", "pickle"): 2_000,
    ("0.5.7", "shm"): 2_000,
    ("0.5.7", "pickle"): 1_000,
}


@pytest.mark.parametrize("module_real_server", SERVERS, indirect=True)
async def test_soak(module_real_server: Any) -> None:
    n_ops = SHORT[module_real_server.generation, module_real_server.mode]
    await run_soak(module_real_server, n_ops, seed=n_ops)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("module_real_server", SERVERS, indirect=True)
async def test_soak_long(module_real_server: Any) -> None:
    n_ops = LONG[module_real_server.generation, module_real_server.mode]
    await run_soak(module_real_server, n_ops, seed=n_ops + 1)
