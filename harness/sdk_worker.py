"""The OFFICIAL LMCache SDK (``lmcache.sdk.kvcache``) behind JSON lines.

Run with an LMCACHE venv's python: the 0.5.6 SDK (``.lmcache-venv``) or the
0.5.7rc3 one (``.lmcache-venv-057``, which speaks that generation's wire: packed
token keys, the msgpack tensor envelope on the inline transport); both have the
same public API. Driven by ``harness/workers.py::SDKWorker`` (framing:
``_worker_loop.py``). lmcache's log output goes to stderr. The ready line
carries ``lmcache_version`` and ``generation`` (``"0.5.6"`` or ``"0.5.7"``).

Commands (request -> reply, besides ``ok``/``id``):

* ``connect`` {url, http_url, model_name, timeout=30, geometry=null}
  -> {instance_id, chunk_size, shm_name, transfer}
  ``lmcache.sdk.kvcache.connect(url, http_url, model_name, timeout)``; it reads
  ``/config`` and ``/status`` (a vLLM-style ``cache_context_meta`` entry for
  ``model_name`` must exist, e.g. from ``engine_worker.py``) and registers an
  engine-driven context. ``transfer`` is the SDK's transfer class name
  (``...Shm``, or ``...Pickle`` on 0.5.6 / ``...Inline`` on 0.5.7). ``geometry``
  ``[layers, hidden]``: the shape of the random bfloat16 KVs the benchmark commands
  store (required by those that store).
* ``store`` {tokens, kv_file, cache_salt="", request_configs=null} -> {result: bool}
  ``ctx.store(kv, tokens, cache_salt, request_configs)``; ``kv_file`` is a
  ``torch.save`` of ``[2, L, T, D]``.
* ``retrieve`` {tokens, out_file, cache_salt="", request_configs=null} -> {hit_tokens: n}
  ``ctx.retrieve(tokens, cache_salt, request_configs)``; when n > 0 the tensor
  ``[2, L, n, D]`` is written to ``out_file``; a miss gives n = 0.
* ``close`` -> {} (``ctx.close()``; the SDK never unregisters).
* ``quit`` -> {} (closes first).

The official SDK's side of the benchmarks (``benchmarks/suite/``), timed in this process;
tokens are ``range(start, start + tokens)``, built before the clock starts:

* ``bench`` {case: "store" | "retrieve" | "pair", chunks, iters, base} -> {times: [s, ...], cpu}
  ``store``: each iteration stores fresh tokens; ``retrieve``: stores once, then times
  retrieves of the same tokens; ``pair``: fresh tokens, store then retrieve. ``cpu``: this
  process's CPU seconds (``time.process_time``) over the timed iterations.
* ``concurrent`` {op: "store" | "retrieve", starts, tokens, threads} -> {elapsed, cpu, done}
  one operation per start, spread over ``threads`` threads sharing the one context (a
  ``ThreadPoolExecutor``); ``retrieve`` expects the prompts to be stored already, ``store``
  stores one random KV under each.
* ``fresh`` {url, http_url, model_name, start, tokens} -> {connect_s, first_s, second_s}
  a new context (``kvcache.connect``), two timed retrieves of stored tokens, closed again.
* ``untouched`` {url, http_url, model_name, op: "store" | "retrieve", starts, tokens}
  -> {times: [s, ...], faults: [n, ...]} a new context (a fresh mapping of the pool), one
  timed operation per start (``store``: a random KV under fresh tokens; ``retrieve``:
  tokens stored before, into the new tensor the SDK returns, dropped before the next),
  with this process's minor page faults during each; closed again.
* ``remap`` {pairs: [[source_start, target_start], ...], num_tokens} -> {elapsed, hits, stored}
  for each pair, in a loop (what a user of the SDK writes): ``kv = ctx.retrieve(source)``
  then ``ctx.store(kv, target)``.

``fresh`` and ``untouched`` give their own contexts the SDK timeout :data:`BENCH_TIMEOUT`.
"""

from __future__ import annotations

import sys

# Run as a script (``python path/to/this.py``), so its own directory is sys.path[0]:
# the sibling _worker_loop imports by its bare name, with no sys.path edit.
from _worker_loop import WorkerExit, error_reply, ready_line, send, serve, take_protocol_stdout

PROTO = take_protocol_stdout()

try:
    import resource
    import time
    from concurrent.futures import ThreadPoolExecutor
    from typing import Any

    import torch
    from lmcache.sdk import kvcache
except Exception as _exc:  # pragma: no cover - reported to the parent
    send(PROTO, {**error_reply(_exc), "ready": False})
    sys.exit(1)

#: The SDK timeout (s) of the contexts ``fresh`` and ``untouched`` open.
BENCH_TIMEOUT = 60.0


def _transfer_name(ctx: Any) -> str:
    """Best-effort name of the engine-driven transfer strategy the SDK picked."""
    wrapper = getattr(ctx, "transfer_ctx", None)
    for attr in ("_ctx", "ctx", "_engine_driven_context", "engine_driven_context", "_context"):
        inner = getattr(wrapper, attr, None)
        if inner is not None:
            return type(inner).__name__
    return type(wrapper).__name__


def _tokens(start: int, n: int) -> list[int]:
    return list(range(int(start), int(start) + n))


class SDK:
    def __init__(self) -> None:
        self.ctx: Any = None
        self.geometry: list[int] | None = None  # [layers, hidden] of the benchmark KVs
        self._kvs: dict[int, Any] = {}

    def _require(self) -> Any:
        if self.ctx is None:
            raise RuntimeError("not connected; send 'connect' first")
        return self.ctx

    def connect(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.ctx is not None:
            raise RuntimeError("already connected; send 'close' first")
        ctx = kvcache.connect(
            url=str(req["url"]),
            http_url=str(req["http_url"]),
            model_name=str(req["model_name"]),
            timeout=float(req.get("timeout", 30.0)),
        )
        self.ctx = ctx
        geometry = req.get("geometry")
        self.geometry = None if geometry is None else [int(g) for g in geometry]
        return {
            "instance_id": int(ctx.instance_id),
            "chunk_size": int(ctx.chunk_size),
            "shm_name": str(getattr(ctx, "shm_name", "")),
            "transfer": _transfer_name(ctx),
        }

    def store(self, req: dict[str, Any]) -> dict[str, Any]:
        ctx = self._require()
        kv = torch.load(req["kv_file"], weights_only=True)
        tokens = [int(t) for t in req["tokens"]]
        result = ctx.store(
            kv,
            tokens,
            cache_salt=str(req.get("cache_salt", "")),
            request_configs=req.get("request_configs"),
        )
        return {"result": bool(result)}

    def retrieve(self, req: dict[str, Any]) -> dict[str, Any]:
        ctx = self._require()
        tokens = [int(t) for t in req["tokens"]]
        out = ctx.retrieve(
            tokens,
            cache_salt=str(req.get("cache_salt", "")),
            request_configs=req.get("request_configs"),
        )
        if out is None:
            return {"hit_tokens": 0}
        # Token axis of the SDK's result is ndim - 2 ([2, L, n, D]).
        n = int(out.shape[-2])
        torch.save(out.contiguous(), str(req["out_file"]))
        return {"hit_tokens": n, "shape": list(out.shape), "dtype": str(out.dtype)}

    # ------------------------------------------------------------ benchmark commands
    def _kv(self, n_tokens: int) -> Any:
        """A random KV of ``n_tokens`` (made once per size: 512 MiB of randn costs seconds)."""
        if n_tokens not in self._kvs:
            if self.geometry is None:
                raise RuntimeError("this command stores random KVs: connect with a geometry [layers, hidden]")
            layers, hidden = self.geometry
            self._kvs[n_tokens] = torch.randn(2, layers, n_tokens, hidden, dtype=torch.float32).to(
                torch.bfloat16
            )
        return self._kvs[n_tokens]

    def bench(self, req: dict[str, Any]) -> dict[str, Any]:
        ctx = self._require()
        n = int(req["chunks"]) * int(ctx.chunk_size)
        kv = self._kv(n)
        base = int(req["base"])
        times: list[float] = []
        tokens = _tokens(base, n)
        if req["case"] == "retrieve":
            ctx.store(kv, tokens)
            assert ctx.retrieve(tokens) is not None
        cpu0 = time.process_time()
        for i in range(int(req["iters"])):
            if req["case"] == "retrieve":
                t0 = time.perf_counter()
                got = ctx.retrieve(tokens)
                times.append(time.perf_counter() - t0)
                assert got is not None and got.shape[2] == n
                del got
                continue
            tokens = _tokens(base + (i + 1) * n, n)
            t0 = time.perf_counter()
            ok = ctx.store(kv, tokens)
            if req["case"] == "pair":
                got = ctx.retrieve(tokens)
                assert got is not None
            times.append(time.perf_counter() - t0)
            assert ok
        return {"times": times, "cpu": time.process_time() - cpu0}

    def concurrent(self, req: dict[str, Any]) -> dict[str, Any]:
        ctx = self._require()
        n = int(req["tokens"])
        prompts = [_tokens(s, n) for s in req["starts"]]
        retrieve = req["op"] == "retrieve"
        kv = None if retrieve else self._kv(n)

        def one(tokens: list[int]) -> bool:
            if retrieve:
                got = ctx.retrieve(tokens)
                return got is not None and got.shape[2] == n
            return bool(ctx.store(kv, tokens))

        with ThreadPoolExecutor(int(req["threads"])) as pool:
            t0, cpu0 = time.perf_counter(), time.process_time()
            done = sum(pool.map(one, prompts))
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        return {"elapsed": elapsed, "cpu": cpu, "done": done}

    @staticmethod
    def _new_context(req: dict[str, Any]) -> Any:
        return kvcache.connect(req["url"], req["http_url"], req["model_name"], timeout=BENCH_TIMEOUT)

    def fresh(self, req: dict[str, Any]) -> dict[str, Any]:
        n = int(req["tokens"])
        tokens = _tokens(req["start"], n)
        t0 = time.perf_counter()
        ctx = self._new_context(req)
        t1 = time.perf_counter()
        try:
            got = ctx.retrieve(tokens)
            t2 = time.perf_counter()
            assert got is not None and got.shape[2] == n
            del got
            t3 = time.perf_counter()
            got = ctx.retrieve(tokens)
            t4 = time.perf_counter()
            assert got is not None
        finally:
            ctx.close()
        return {"connect_s": t1 - t0, "first_s": t2 - t1, "second_s": t4 - t3}

    def untouched(self, req: dict[str, Any]) -> dict[str, Any]:
        n = int(req["tokens"])
        kv = self._kv(n) if req["op"] == "store" else None
        ctx = self._new_context(req)
        times: list[float] = []
        faults: list[int] = []
        try:
            for start in req["starts"]:
                tokens = _tokens(start, n)
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                if kv is not None:
                    ok = ctx.store(kv, tokens)
                else:
                    got = ctx.retrieve(tokens)
                    ok = got is not None and got.shape[2] == n
                times.append(time.perf_counter() - t0)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                assert ok
                got = None
        finally:
            ctx.close()
        return {"times": times, "faults": faults}

    def remap(self, req: dict[str, Any]) -> dict[str, Any]:
        ctx = self._require()
        n = int(req["num_tokens"])
        pairs = [(_tokens(s, n), _tokens(t, n)) for s, t in req["pairs"]]
        hits = stored = 0
        t0 = time.perf_counter()
        for source, target in pairs:
            kv = ctx.retrieve(source)
            if kv is None:
                continue
            hits += 1
            stored += bool(ctx.store(kv, target))
            del kv
        return {"elapsed": time.perf_counter() - t0, "hits": hits, "stored": stored}

    # ------------------------------------------------------------ lifecycle
    def close(self, _req: dict[str, Any]) -> dict[str, Any]:
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            ctx.close()
        return {}

    def quit(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            self.close(req)
        except Exception as exc:
            print(f"close on quit failed: {exc!r}", file=sys.stderr)
        raise WorkerExit({})

    def shutdown(self) -> None:
        if self.ctx is not None:
            self.close({})


def main() -> int:
    sdk = SDK()
    send(PROTO, ready_line("sdk"))
    handlers = {
        "connect": sdk.connect,
        "store": sdk.store,
        "retrieve": sdk.retrieve,
        "bench": sdk.bench,
        "concurrent": sdk.concurrent,
        "fresh": sdk.fresh,
        "untouched": sdk.untouched,
        "remap": sdk.remap,
        "close": sdk.close,
        "quit": sdk.quit,
    }
    return serve(PROTO, handlers, on_exit=sdk.shutdown)


if __name__ == "__main__":
    sys.exit(main())
