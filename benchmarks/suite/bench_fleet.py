"""KV events and the fleet (issue 33): how many events one subscriber keeps up with, the
prefix index's lookup time and memory, and a routed retrieve against asking every server.

    .venv/bin/python -m benchmarks.suite.bench_fleet [--events 16384] [--rounds 3]
        [--prompts 128] [--index-chunks 1000000] [--json]

Three parts, in this order:

* ``index`` (no server; pure CPU): a :class:`~lmcache_async.fleet.PrefixIndex` filled with
  ``--index-chunks`` random 32-byte chunk hashes spread over 8 servers, then a 4096-token
  prompt whose chunks one server holds (every chunk: the walk's worst case) looked up
  at chunk sizes 16 and 256 (256 and 16 chunks): the chunk hashes of the prompt
  (``chunk_hashes``, blake3) and the index walk (``prefix_chunks``) timed apart, median
  of 2,000 lookups per round; a miss (first chunk unknown) too. Memory per chunk:
  ``tracemalloc`` traced bytes after the fill minus before, over the chunks held (the
  hashes given were allocated before tracing started, so only what the index keeps is
  counted: the dict's table, its 64-bit int keys and bitmask values), and the
  ``sys.getsizeof`` sum of the dict, its keys and its non-cached values as a check.
  Filling an index (untraced) and inserting into the full one (the oldest dropped to
  make room) are timed as well.
* ``events`` (one real server, chunk size 16): ``--events`` ``stored`` events produced by
  engine-path stores (``harness.workers.EngineWorker``, the lmcache-driven path that vLLM
  uses: stores made by clients publish no ``stored`` event), 1,024-token prompts (64
  events a store). *Live*: one subscriber (``AsyncClient.kv_events``, 256 records a
  batch) follows while the engine stores as fast as it can; the generator's rate and the
  subscriber's lag when the last event is produced are reported, and a ``Resync``
  would mean it fell behind. *Replay*: the same events, still in the server's log,
  read again from cursor 0 by a new subscriber at ``max_events`` 1, 16, 256 and 1024:
  the rate one subscriber can take in, i.e. what it keeps up with (each batch: one
  ``ack`` round trip, the parse, the handing out of the items).
* ``fleet`` (two real servers, chunk size 16): ``--prompts`` 256-token prompts (16
  chunks, 2 layers x 1 KV head x 128 bf16: 256 KiB each) stored half on each server
  through :meth:`Fleet.store` (which records them in the index), then each retrieved
  one at a time, three ways, alternating the order from round to round:
  ``routed`` (:meth:`Fleet.retrieve`: the index names the server, one retrieve);
  ``lookup_all`` (a ``lookup`` on every server at once, then the retrieve from the
  longest hit: what a client without an index does); ``retrieve_all`` (a retrieve from
  every server at once, keeping the hit). Median µs per prompt per round; the ratios
  are per round, the other way's time over the routed one's (> 1: routing is faster).
  Every retrieved tensor is checked bitwise against what was stored.

Each part's figures are medians of the rounds, with their range.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.harness import server_python, spread, start_servers
from harness.real_server import RealLMCacheServer
from lmcache_async.events import StoredEvent
from lmcache_async.fleet import Fleet, PrefixIndex
from lmcache_async.hashing import chunk_hashes

CS = 16
GEOM = lmc.KVGeometry(num_layers=2, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16, block_size=16)
PROMPT_TOKENS = 4096
INDEX_SERVERS = 8
EVENT_PROMPT = 1024  # tokens per engine store: 64 chunks, 64 `stored` events
REPLAY_BATCHES = (1, 16, 256, 1024)
FLEET_PROMPT = 256
WAYS = ("routed", "lookup_all", "retrieve_all")


# --------------------------------------------------------------------------- index


def _index_part(chunks: int, rounds: int, lookups: int = 2000) -> dict[str, Any]:
    hashes = [os.urandom(32) for _ in range(chunks)]
    prompt = [int.from_bytes(os.urandom(3), "big") for _ in range(PROMPT_TOKENS)]
    per_cs = {cs: chunk_hashes(prompt, cs) for cs in (16, 256)}
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(max_chunks=chunks + sum(len(h) for h in per_cs.values()))
    for s in range(INDEX_SERVERS):
        index.add(s, hashes[s::INDEX_SERVERS])
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    held = len(index)
    m = index._map
    sized = (
        sys.getsizeof(m)
        + sum(sys.getsizeof(k) for k in m)
        + sum(sys.getsizeof(v) for v in m.values() if v > 256)
    )
    for hs in per_cs.values():
        index.add(3, hs)
    up = (1 << INDEX_SERVERS) - 1
    rows = []
    for cs, hs in per_cs.items():
        assert index.prefix_chunks(hs, up) == {3: len(hs)}
        miss = [os.urandom(32), *hs[1:]]
        assert index.prefix_chunks(miss, up) == {}
        hash_us, walk_us, miss_us = [], [], []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(lookups // 10):
                chunk_hashes(prompt, cs)
            hash_us.append((time.perf_counter() - t) / (lookups // 10))
            t = time.perf_counter()
            for _ in range(lookups):
                index.prefix_chunks(hs, up)
            walk_us.append((time.perf_counter() - t) / lookups)
            t = time.perf_counter()
            for _ in range(lookups):
                index.prefix_chunks(miss, up)
            miss_us.append((time.perf_counter() - t) / lookups)
        rows.append(
            {
                "chunk_size": cs,
                "prompt_chunks": len(hs),
                "hash_us": spread(hash_us, scale=1e6, digits=1),
                "walk_hit_us": spread(walk_us, scale=1e6, digits=1),
                "walk_miss_us": spread(miss_us, scale=1e6, digits=2),
                "lookup_us": spread(
                    [h + w for h, w in zip(hash_us, walk_us, strict=True)], scale=1e6, digits=1
                ),
            }
        )
    # inserting into the full index: each insert past the bound drops the oldest
    full = PrefixIndex(max_chunks=chunks)
    t = time.perf_counter()
    full.add(0, hashes)
    fill_s = time.perf_counter() - t
    extra = [os.urandom(32) for _ in range(max(chunks // 5, 1))]
    t = time.perf_counter()
    full.add(1, extra)
    insert_full_s = time.perf_counter() - t
    assert len(full) <= chunks and full.evicted >= len(extra)
    return {
        "chunks": held,
        "servers": INDEX_SERVERS,
        "prompt_tokens": PROMPT_TOKENS,
        "lookups_per_round": lookups,
        "rounds": rounds,
        "fill_us_per_chunk": round(fill_s / chunks * 1e6, 3),
        "insert_full_us_per_chunk": round(insert_full_s / len(extra) * 1e6, 3),
        "inserted_into_full": len(extra),
        "tracemalloc_bytes_per_chunk": round(traced / held, 1),
        "getsizeof_bytes_per_chunk": round(sized / held, 1),
        "rows": rows,
    }


# --------------------------------------------------------------------------- events


def _random_kv(tokens: int) -> torch.Tensor:
    return torch.randn(GEOM.kv_shape(tokens), dtype=torch.float32).to(GEOM.dtype)


async def _count_stored(events: Any, n: int, model: str, marks: list[float] | None = None) -> int:
    """Consume until ``n`` stored events of ``model``; returns the Resyncs seen."""
    got = resyncs = 0
    async for ev in events:
        if isinstance(ev, StoredEvent):
            if ev.model_name == model:
                got += 1
                if marks is not None:
                    marks.append(time.perf_counter())
                if got >= n:
                    break
        else:
            resyncs += 1
    return resyncs


async def _events_part(srv: RealLMCacheServer, python: Path, n_events: int, rounds: int) -> dict[str, Any]:
    from harness.workers import EngineWorker

    model = f"bench-events-{os.getpid()}"
    stores = -(-n_events // (EVENT_PROMPT // CS))
    n_events = stores * (EVENT_PROMPT // CS)
    prompts = [[20_000 + i * EVENT_PROMPT + j for j in range(EVENT_PROMPT)] for i in range(stores)]
    kv = _random_kv(EVENT_PROMPT)
    async with lmc.AsyncClient(srv.url, srv.http_url, model, geometry=GEOM, timeout=60) as client:
        with EngineWorker(srv, python=python) as eng:
            eng.register(
                model,
                num_layers=GEOM.num_layers,
                num_kv_heads=GEOM.num_kv_heads,
                head_dim=GEOM.head_dim,
                block_size=16,
                num_blocks=2 * EVENT_PROMPT // 16,
                dtype=GEOM.dtype,
            )
            # live: one subscriber while the engine stores as fast as it can
            async with contextlib.aclosing(client.kv_events(max_events=256)) as events:
                marks: list[float] = []
                consumer = asyncio.ensure_future(_count_stored(events, n_events, model, marks))
                end = time.monotonic() + 30
                while srv.status()["kv_events"]["subscribers"] != 1:
                    if time.monotonic() > end:
                        raise TimeoutError("the subscription did not show on the server")
                    await asyncio.sleep(0.05)
                t0 = time.perf_counter()
                for p in prompts:
                    ok = await asyncio.to_thread(eng.store, p, kv, wait_visible=False, timeout=60)
                    assert ok, "engine store failed"
                t_gen = time.perf_counter() - t0
                live_resyncs = await asyncio.wait_for(consumer, 120)
                lag = marks[-1] - (t0 + t_gen)
                t_sub = marks[-1] - t0
        status = srv.status()["kv_events"]
        replay: dict[int, list[float]] = {m: [] for m in REPLAY_BATCHES}
        for rnd in range(rounds):
            order = REPLAY_BATCHES[rnd % 4 :] + REPLAY_BATCHES[: rnd % 4]
            for m in order:
                async with contextlib.aclosing(client.kv_events(max_events=m)) as events:
                    t = time.perf_counter()
                    resyncs = await asyncio.wait_for(_count_stored(events, n_events, model), 300)
                    replay[m].append(n_events / (time.perf_counter() - t))
                    assert resyncs == 0, resyncs
            print(f"  fleet/events: replay round {rnd} done", file=sys.stderr)
    return {
        "generator": "engine-path stores (harness EngineWorker, lmcache-driven as vLLM), "
        f"{EVENT_PROMPT}-token prompts, {EVENT_PROMPT // CS} stored events each",
        "events": n_events,
        "stores": stores,
        "server_log_size": status.get("log_size", status.get("capacity")),
        "live": {
            "max_events": 256,
            "generated_per_s": round(n_events / t_gen),
            "consumed_per_s": round(n_events / t_sub),
            "lag_after_last_store_ms": round(lag * 1e3, 1),
            "resyncs": live_resyncs,
        },
        "replay_per_s": [
            {"max_events": m, "events_per_s": spread(replay[m], digits=0)} for m in REPLAY_BATCHES
        ],
        "rounds": rounds,
    }


# --------------------------------------------------------------------------- fleet


async def _fleet_part(
    a: RealLMCacheServer, b: RealLMCacheServer, prompts: int, rounds: int
) -> dict[str, Any]:
    model = f"bench-fleet-{os.getpid()}"
    toks = [[30_000_000 + i * FLEET_PROMPT + j for j in range(FLEET_PROMPT)] for i in range(prompts)]
    kvs = [_random_kv(FLEET_PROMPT) for _ in range(prompts)]
    per: dict[str, list[float]] = {w: [] for w in WAYS}
    ratios: dict[str, list[float]] = {w: [] for w in WAYS[1:]}
    async with Fleet([(a.url, a.http_url), (b.url, b.http_url)], model, geometry=GEOM, timeout=60) as fleet:
        for i, (t, kv) in enumerate(zip(toks, kvs, strict=True)):
            assert (await fleet.store(kv, t, server=fleet.servers[i % 2])).value is True
        for c in fleet.clients:
            await c.drain()

        async def routed(i: int) -> torch.Tensor | None:
            got = await fleet.retrieve(toks[i])
            assert got.route.server == fleet.servers[i % 2] and got.route.source == "index", got.route
            return got.value

        async def lookup_all(i: int) -> torch.Tensor | None:
            route = await fleet.best(toks[i], fanout="always")
            assert route.server == fleet.servers[i % 2], route
            return await route.client.retrieve(toks[i])

        async def retrieve_all(i: int) -> torch.Tensor | None:
            got = await asyncio.gather(*(c.retrieve(toks[i]) for c in fleet.clients))
            hits = [g for g in got if g is not None]
            return max(hits, key=lambda g: g.shape[2]) if hits else None

        ways = {"routed": routed, "lookup_all": lookup_all, "retrieve_all": retrieve_all}
        for rnd in range(rounds + 1):
            order = WAYS[rnd % 3 :] + WAYS[: rnd % 3]
            took: dict[str, float] = {}
            for w in order:
                t0 = time.perf_counter()
                for i in range(prompts):
                    value = await ways[w](i)
                    assert value is not None and torch.equal(value, kvs[i]), (w, i)
                took[w] = (time.perf_counter() - t0) / prompts
            if rnd:  # round 0 warms up
                for w in WAYS:
                    per[w].append(took[w])
                for w in WAYS[1:]:
                    ratios[w].append(took[w] / took["routed"])
            print(f"  fleet/fleet: round {rnd}{' (warm-up)' if rnd == 0 else ''} done", file=sys.stderr)
    return {
        "case": f"{FLEET_PROMPT}-token prompts ({FLEET_PROMPT // CS} chunks, 256 KiB), two SHM servers, "
        "one retrieve at a time",
        "prompts": prompts,
        "rounds": rounds,
        "us_per_retrieve": {w: spread(per[w], scale=1e6, digits=0) for w in WAYS},
        "vs_routed": {w: spread(ratios[w], digits=2) for w in WAYS[1:]},
    }


# --------------------------------------------------------------------------- entry points


def servers(python: Path, extra: Sequence[str] = ()) -> tuple[RealLMCacheServer, RealLMCacheServer]:
    """The two servers of the section (SHM, chunk size 16, 1 GB of L1 each; not started)."""
    return (
        RealLMCacheServer("shm", venv_python=python, chunk_size=CS, l1_size_gb=1, extra_args=extra),
        RealLMCacheServer("shm", venv_python=python, chunk_size=CS, l1_size_gb=1, extra_args=extra),
    )


def section(*, python: Path, events: int, rounds: int, prompts: int, index_chunks: int) -> dict[str, Any]:
    """Run the three parts (starts and stops its own two servers); blocks until done."""
    t0 = time.perf_counter()
    result: dict[str, Any] = {"index": _index_part(index_chunks, rounds)}
    print("  fleet/index: done", file=sys.stderr)
    a, b = servers(python)
    start_servers([a, b])
    try:
        result["events"] = asyncio.run(_events_part(a, python, events, rounds))
        result["fleet"] = asyncio.run(_fleet_part(a, b, prompts, rounds))
        result["server_version"] = a.get_json("/lmc_version")
    finally:
        a.stop()
        b.stop()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    return result


def summary(result: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    ix, ev, fl = result["index"], result.get("events"), result.get("fleet")
    lines = [
        f"index: {ix['chunks']:,} chunks, {ix['tracemalloc_bytes_per_chunk']} B/chunk (tracemalloc), "
        f"{ix['getsizeof_bytes_per_chunk']} B/chunk (getsizeof)"
    ]
    for r in ix["rows"]:
        lines.append(
            f"  4096-token prompt at chunk size {r['chunk_size']}: hashes {r['hash_us']['median']} µs + "
            f"walk {r['walk_hit_us']['median']} µs = {r['lookup_us']['median']} µs"
        )
    if ev:
        lv = ev["live"]
        lines.append(
            f"events: live {lv['generated_per_s']}/s generated, lag {lv['lag_after_last_store_ms']} ms, "
            f"resyncs {lv['resyncs']}; replay "
            + ", ".join(f"{r['max_events']}: {r['events_per_s']['median']:.0f}/s" for r in ev["replay_per_s"])
        )
    if fl:
        us = fl["us_per_retrieve"]
        lines.append(
            "fleet: µs/retrieve "
            + ", ".join(f"{w} {us[w]['median']:.0f}" for w in WAYS)
            + "; vs routed "
            + ", ".join(f"{w} {v['median']}x" for w, v in fl["vs_routed"].items())
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--index-chunks", type=int, default=1_000_000)
    parser.add_argument("--index-only", action="store_true", help="the index part alone (no server)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.index_only:
        result: dict[str, Any] = {"index": _index_part(args.index_chunks, args.rounds)}
    else:
        result = section(
            python=server_python("0.5.6"),
            events=args.events,
            rounds=args.rounds,
            prompts=args.prompts,
            index_chunks=args.index_chunks,
        )
    print(json.dumps(result, indent=1) if args.json else summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
