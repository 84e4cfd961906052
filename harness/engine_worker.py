"""Fake inference-engine (vLLM-style) worker for the REAL LMCache server.

Run with an LMCACHE venv's python: lmcache 0.5.6 (``.lmcache-venv``) or the
0.5.7rc3 generation (``.lmcache-venv-057``); the worker reads the installed
version and speaks that generation's key format (0.5.6: ``token_ids``; 0.5.7:
packed ``token_bytes``, built by lmcache's own ``IPCCacheServerKey.from_token_ids``).
Every other call is the same public API in both. Spoken to over JSON lines on
stdin/stdout by ``harness/workers.py::EngineWorker`` (protocol framing:
``_worker_loop.py``). lmcache's log output goes to stderr.

It registers a paged, vLLM flash-attention KV cache through lmcache's own
lmcache-driven client path -- exactly what vLLM's worker adapter
(``lmcache/integration/vllm/vllm_multi_process_adapter.py``) does -- and then
stores / retrieves through that registration, so tests can check that KV an
inference engine writes is readable by other clients and vice versa.

Layout: per layer ``model.layers.{i}.self_attn.attn`` a CPU tensor
``[2, num_blocks, BS, NH, HS]`` (K/V, block, offset, head, head dim). Token t
of a request lives at block ``block_ids[t // BS]``, offset ``t % BS``. The
contiguous exchange format is ``[2, L, T, NH*HS]`` (heads then head dim
flattened), the LMCache object layout. Block 0 is never used: the server's
``--null-block-id`` is 0 (vLLM's null block) and all-null chunks are skipped.

Parallel setup mirrors vLLM on a single GPU (TP=PP=1, one server):
``world_size`` (kv world size) = 1, ``worker_id`` = 0, ``num_kv_readers`` = 1,
``tp_size`` passed to ``lookup`` = 1.

The ready line carries ``lmcache_version`` (e.g. ``"0.5.6"``, ``"0.5.7rc3.dev0"``)
and ``generation`` (``"0.5.6"`` or ``"0.5.7"``).

Transfer modes (``register``'s ``transfer_mode``): ``"lmcache_driven"`` (default)
is vLLM's path on a GPU: the cache is registered with ``register_kv_cache`` and the
server gathers/scatters it (real servers only). ``"engine_driven"`` is lmcache's
own worker path for non-CUDA devices: the worker gathers/scatters itself and moves
the chunks with ``prepare_store``/``commit_store``/``prepare_retrieve``/
``commit_retrieve`` (SHM slots or the inline payload of its generation), which the
embedded server serves too; such a registration does not appear in ``/status``
``cache_context_meta``.

Commands (request -> reply, besides ``ok``/``id``):

* ``register`` {url, model_name, num_layers, num_kv_heads, head_dim, block_size,
  num_blocks, dtype ("bfloat16"...), timeout=30, seed=0, transfer_mode="lmcache_driven",
  engine_groups=None (the layer indices of each KV cache group: several for a hybrid
  model; default one group of every layer)}
  -> {instance_id, chunk_size, blocks_in_chunk, kv_shape, layer_names, kv_segments,
  transfer}  (``transfer``: the class name of lmcache's transfer context)
* ``store`` {tokens, kv_file, cache_salt="", timeout, wait_visible=true,
  visible_timeout=min(timeout, 10)}
  -> {stored (server's bool), stored_tokens, visible_tokens, visible_probes, block_ids}
  Only whole chunks are stored (``T' = T // CS * CS``). The server commits an
  lmcache-driven store asynchronously (a few ms after its reply), so by
  default the worker then polls lookups until all ``T'`` tokens are visible
  (``visible_tokens``; 0 when not waited or not stored).
* ``retrieve`` {tokens, out_file, cache_salt="", timeout}
  -> {hit_tokens, block_ids}; if hit_tokens > 0, ``out_file`` holds the
  ``[2, L, hit_tokens, NH*HS]`` tensor (``torch.save``).
* ``ping`` {timeout} -> {result}: ``ping(instance_id)`` like vLLM's heartbeat
  (note: this makes the server reap the registration after 120 s of silence).
* ``state`` -> {registered, instance_id, free_blocks, pid}
* ``unregister`` {timeout} -> {kv_segments (left after release)}
* ``quit`` -> {kv_segments} (unregisters first if needed), then the worker exits.
"""

from __future__ import annotations

import sys

# Run as a script (``python path/to/this.py``), so its own directory is sys.path[0]:
# the sibling _worker_loop imports by its bare name, with no sys.path edit.
from _worker_loop import WorkerExit, error_reply, ready_line, send, serve, take_protocol_stdout

PROTO = take_protocol_stdout()

try:
    import gc
    import os
    import random
    import threading
    import time
    import uuid
    from typing import Any

    import torch
    import zmq
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.group_view import EngineGroupInfo
    from lmcache.v1.multiprocess.transfer_context import create_transfer_context
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory
except Exception as _exc:  # pragma: no cover - reported to the parent
    send(PROTO, {**error_reply(_exc), "ready": False})
    sys.exit(1)

WORLD_SIZE = 1  # kv world size of a single-GPU vLLM (TP=1, PP=1, 1 server)
WORKER_ID = 0  # kv worker id of that single worker
NUM_KV_READERS = 1  # non-MLA: one reader per object
TP_SIZE = 1  # sent with lookup (arity only)
NULL_BLOCK_ID = 0  # server default --null-block-id
#: lmcache's transfer context modes this worker can register with (see the docstring).
TRANSFER_MODES = ("lmcache_driven", "engine_driven")


#: 0.5.7 keys carry packed ``token_bytes`` (a map with ``token_ids`` is rejected).
PACKED_TOKENS = hasattr(IPCCacheServerKey, "from_token_ids")


def _kv_segments() -> list[str]:
    prefix = f"lmcache_kv_{os.getpid()}_"
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


class Engine:
    def __init__(self) -> None:
        self.zmq_ctx: Any = None
        self.req_client: Any = None
        self.transfer_ctx: Any = None
        self.kv_caches: dict[str, torch.Tensor] | None = None
        self.instance_id = 0
        self.model_name = ""
        self.num_layers = 0
        self.num_kv_heads = 0
        self.head_dim = 0
        self.block_size = 0
        self.num_blocks = 0
        self.dtype: torch.dtype = torch.bfloat16
        self.chunk_size = 0
        self.blocks_in_chunk = 0
        self.timeout = 30.0
        self.free_blocks: list[int] = []
        self.rng = random.Random(0)
        self.visible_probes = 0

    # ------------------------------------------------------------ helpers
    def _require_registered(self) -> None:
        if self.transfer_ctx is None or self.kv_caches is None:
            raise RuntimeError("not registered; send 'register' first")

    def _timeout(self, req: dict[str, Any]) -> float:
        return float(req.get("timeout", self.timeout))

    def _alloc(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise RuntimeError(f"need {n} free blocks, have {len(self.free_blocks)}")
        # Scattered, non-monotonic block ids exercise the paged mapping.
        picked = self.rng.sample(self.free_blocks, n)
        taken = set(picked)
        self.free_blocks = [b for b in self.free_blocks if b not in taken]
        return picked

    def _free(self, blocks: list[int]) -> None:
        self.free_blocks.extend(blocks)

    def _key(
        self, tokens: list[int], end: int, request_id: str, cache_salt: str, worker_id: int | None
    ) -> Any:
        fields: dict[str, Any] = {
            "model_name": self.model_name,
            "world_size": WORLD_SIZE,
            "worker_id": worker_id,
            "start": 0,
            "end": end,
            "request_id": request_id,
            "cache_salt": cache_salt,
            "request_configs": None,
            "num_kv_readers": NUM_KV_READERS,
        }
        if PACKED_TOKENS:
            return IPCCacheServerKey.from_token_ids(token_ids=tokens, **fields)
        return IPCCacheServerKey(token_ids=tuple(tokens), **fields)

    def _slot_index(self, block_ids: list[int], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        tok = torch.arange(n_tokens)
        blocks = torch.tensor(block_ids, dtype=torch.long)[tok // self.block_size]
        return blocks, tok % self.block_size

    def _end_session(self, request_id: str, timeout: float) -> None:
        self.req_client.end_session(request_id).result(timeout=timeout)

    def _lookup_chunks(
        self, tokens: list[int], end: int, request_id: str, cache_salt: str, timeout: float
    ) -> int:
        """vLLM's scheduler-side lookup: LOOKUP (worker_id=None), wait for its
        ACK, then poll QUERY_PREFETCH_STATUS until it is not None. Returns the
        hit length in chunks; the hit chunks stay read-locked."""
        lookup_key = self._key(tokens, end, request_id, cache_salt, None)
        self.req_client.lookup(lookup_key, TP_SIZE).result(timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            chunks = self.req_client.query_prefetch_status(request_id).result(
                timeout=max(0.1, deadline - time.monotonic())
            )
            if chunks is not None:
                return int(chunks)
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefetch of {request_id} not done in {timeout} s")
            time.sleep(0.005)

    def _wait_visible(self, tokens: list[int], n: int, cache_salt: str, timeout: float) -> int:
        """Wait until a lookup sees the first ``n`` tokens; returns the tokens seen.

        The lmcache-driven STORE reply comes back before the objects are
        committed: the server commits them (finish_write) from a stream
        callback that its DeviceHostFuncDispatcher thread drains every 5 ms.
        A lookup right after the store can therefore miss. This probes with
        lookup + free_lookup_locks + end_session (fresh request id each time)
        so that, once store() returns, every client sees the data.
        """
        deadline = time.monotonic() + timeout
        seen = 0
        self.visible_probes = 0
        while True:
            self.visible_probes += 1
            request_id = f"visible-{uuid.uuid4().hex}"
            try:
                chunks = self._lookup_chunks(tokens, n, request_id, cache_salt, timeout)
                seen = chunks * self.chunk_size
                if chunks:
                    free_key = self._key(tokens, seen, request_id, cache_salt, None)
                    self.req_client.free_lookup_locks(free_key, TP_SIZE).result(timeout=timeout)
            finally:
                self._end_session(request_id, timeout)
            if seen >= n or time.monotonic() > deadline:
                return seen
            time.sleep(0.005)

    # ------------------------------------------------------------ commands
    def register(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.transfer_ctx is not None:
            raise RuntimeError("already registered; send 'unregister' first")
        self.model_name = str(req["model_name"])
        self.num_layers = int(req["num_layers"])
        self.num_kv_heads = int(req["num_kv_heads"])
        self.head_dim = int(req["head_dim"])
        self.block_size = int(req["block_size"])
        self.num_blocks = int(req["num_blocks"])
        dtype = getattr(torch, str(req.get("dtype", "bfloat16")).removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a torch dtype: {req.get('dtype')!r}")
        self.dtype = dtype
        self.timeout = float(req.get("timeout", 30.0))
        self.rng = random.Random(int(req.get("seed", 0)))
        transfer_mode = str(req.get("transfer_mode", "lmcache_driven"))
        if transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode must be one of {TRANSFER_MODES}, got {transfer_mode!r}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) <= 0:
            raise ValueError("geometry values must be positive")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        # vLLM's KV cache groups: one of every layer, or (a hybrid model) several.
        engine_groups = req.get("engine_groups") or [list(range(self.num_layers))]
        if sorted(i for g in engine_groups for i in g) != list(range(self.num_layers)):
            raise ValueError(f"engine_groups must partition the layers 0..{self.num_layers - 1}")

        self.zmq_ctx = zmq.Context()
        self.req_client = RequestClientFactory.create(str(req["url"]), context=self.zmq_ctx)
        try:
            # vLLM's adapter asks the server for its chunk size the same way.
            self.chunk_size = int(self.req_client.get_chunk_size().result(timeout=self.timeout))
            if self.chunk_size % self.block_size:
                raise ValueError(
                    f"chunk size {self.chunk_size} is not a multiple of block size {self.block_size}"
                )
            self.blocks_in_chunk = self.chunk_size // self.block_size

            shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
            kv_caches = {
                f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=self.dtype)
                for i in range(self.num_layers)
            }
            self.instance_id = uuid.uuid4().int & ((1 << 63) - 1)  # as vLLM's adapter
            transfer_ctx = create_transfer_context(
                kv_caches,
                instance_id=self.instance_id,
                req_client=self.req_client,
                mode=transfer_mode,
            )
            # register() wraps every layer for IPC: on CPU the tensor's storage
            # is moved (in place, tensor.set_) into a POSIX shm segment
            # /dev/shm/lmcache_kv_<pid>_<n> that the server maps.
            transfer_ctx.register(
                kv_caches,
                self.model_name,
                WORLD_SIZE,
                self.blocks_in_chunk,
                self.timeout,
                layout_hints={"kv_layout": "NHD"},
                engine_group_infos=[
                    EngineGroupInfo(
                        engine_group_id=group_id,
                        layer_indices=tuple(layers),
                        tokens_per_block=self.block_size,
                    )
                    for group_id, layers in enumerate(engine_groups)
                ],
                engine_type=EngineType.VLLM,
            )
        except BaseException:
            self._release()
            raise
        self.transfer_ctx = transfer_ctx
        self.kv_caches = kv_caches
        self.free_blocks = [b for b in range(self.num_blocks) if b != NULL_BLOCK_ID]
        return {
            "instance_id": self.instance_id,
            "chunk_size": self.chunk_size,
            "blocks_in_chunk": self.blocks_in_chunk,
            "kv_shape": list(shape),
            "layer_names": list(kv_caches),
            "kv_segments": _kv_segments(),
            "transfer": type(transfer_ctx).__name__,
        }

    def store(self, req: dict[str, Any]) -> dict[str, Any]:
        self._require_registered()
        assert self.kv_caches is not None
        timeout = self._timeout(req)
        tokens = [int(t) for t in req["tokens"]]
        cache_salt = str(req.get("cache_salt", ""))
        kv = torch.load(req["kv_file"], weights_only=True)
        d = self.num_kv_heads * self.head_dim
        expect = (2, self.num_layers, len(tokens), d)
        if tuple(kv.shape) != expect:
            raise ValueError(f"kv shape {tuple(kv.shape)} != expected {expect}")
        if kv.dtype != self.dtype:
            raise ValueError(f"kv dtype {kv.dtype} != registered {self.dtype}")
        n = len(tokens) // self.chunk_size * self.chunk_size
        if n == 0:
            return {"stored": False, "stored_tokens": 0, "block_ids": []}

        block_ids = self._alloc(n // self.block_size)
        try:
            # The "forward pass": write K/V of each token into its paged slot.
            b_idx, o_idx = self._slot_index(block_ids, n)
            for layer, cache in enumerate(self.kv_caches.values()):
                src = kv[:, layer, :n].reshape(2, n, self.num_kv_heads, self.head_dim)
                cache[:, b_idx, o_idx] = src

            request_id = f"store-{uuid.uuid4().hex}"
            key = self._key(tokens, n, request_id, cache_salt, WORKER_ID)
            event = self.transfer_ctx.create_recorded_event()
            future = self.transfer_ctx.submit_store(
                request_id, key, self.kv_caches, [block_ids], event, self.blocks_in_chunk
            )
            try:
                stored = bool(future.result(timeout=timeout))
            finally:
                # vLLM's scheduler ends the session when the request finishes.
                self._end_session(request_id, timeout)
        finally:
            self._free(block_ids)
        visible = 0
        if stored and req.get("wait_visible", True):
            visible = self._wait_visible(
                tokens, n, cache_salt, float(req.get("visible_timeout", min(timeout, 10.0)))
            )
        return {
            "stored": stored,
            "stored_tokens": n,
            "visible_tokens": visible,
            "visible_probes": self.visible_probes if visible else 0,
            "block_ids": block_ids,
        }

    def retrieve(self, req: dict[str, Any]) -> dict[str, Any]:
        self._require_registered()
        assert self.kv_caches is not None
        timeout = self._timeout(req)
        tokens = [int(t) for t in req["tokens"]]
        cache_salt = str(req.get("cache_salt", ""))
        out_file = str(req["out_file"])
        aligned = len(tokens) // self.chunk_size * self.chunk_size
        if aligned == 0:
            return {"hit_tokens": 0, "block_ids": []}

        request_id = f"retrieve-{uuid.uuid4().hex}"
        session_open = True
        block_ids: list[int] = []
        try:
            # Scheduler side (vLLM: maybe_submit_lookup_request + check_lookup_result).
            hit = self._lookup_chunks(tokens, aligned, request_id, cache_salt, timeout)
            hit *= self.chunk_size
            if hit == 0:
                return {"hit_tokens": 0, "block_ids": []}

            # Worker side (vLLM: submit_retrieve_request) into fresh blocks,
            # pre-filled with 0xFF bytes (NaN for float dtypes) so that any
            # slot the server does not write breaks the bitwise comparison.
            block_ids = self._alloc(hit // self.block_size)
            for cache in self.kv_caches.values():
                for b in block_ids:
                    cache[:, b].view(torch.uint8).fill_(0xFF)
            key = self._key(tokens, hit, request_id, cache_salt, WORKER_ID)
            event = self.transfer_ctx.create_recorded_event()
            future = self.transfer_ctx.submit_retrieve(
                request_id,
                key,
                self.kv_caches,
                [block_ids],
                event,
                self.blocks_in_chunk,
                skip_first_n_tokens=0,
            )
            ok = bool(future.result(timeout=timeout))
            self._end_session(request_id, timeout)
            session_open = False
            if not ok:
                raise RuntimeError(f"server retrieve returned False (hit_tokens={hit})")

            # Gather the paged slots back into [2, L, hit, NH*HS].
            b_idx, o_idx = self._slot_index(block_ids, hit)
            d = self.num_kv_heads * self.head_dim
            out = torch.empty((2, self.num_layers, hit, d), dtype=self.dtype)
            for layer, cache in enumerate(self.kv_caches.values()):
                out[:, layer] = cache[:, b_idx, o_idx].reshape(2, hit, d)
            torch.save(out, out_file)
            return {"hit_tokens": hit, "block_ids": block_ids}
        finally:
            if session_open:
                try:
                    self._end_session(request_id, timeout)
                except Exception as exc:
                    print(f"end_session({request_id}) failed: {exc!r}", file=sys.stderr)
            self._free(block_ids)

    def ping(self, req: dict[str, Any]) -> dict[str, Any]:
        self._require_registered()
        result = self.req_client.ping(self.instance_id).result(timeout=self._timeout(req))
        return {"result": bool(result)}

    def state(self, _req: dict[str, Any]) -> dict[str, Any]:
        return {
            "registered": self.transfer_ctx is not None,
            "instance_id": self.instance_id,
            "free_blocks": len(self.free_blocks),
            "pid": os.getpid(),
            "kv_segments": _kv_segments(),
        }

    def unregister(self, req: dict[str, Any]) -> dict[str, Any]:
        self._require_registered()
        timeout = self._timeout(req)
        try:
            future = self.transfer_ctx.unregister()
            if future is not None:
                future.result(timeout=timeout)
        finally:
            self._release()
        return {"kv_segments": _kv_segments()}

    def _release(self) -> None:
        if self.transfer_ctx is not None:
            try:
                self.transfer_ctx.close()
            except Exception as exc:
                print(f"transfer_ctx.close failed: {exc!r}", file=sys.stderr)
        self.transfer_ctx = None
        if self.req_client is not None:
            try:
                self.req_client.close()
            except Exception as exc:
                print(f"req_client.close failed: {exc!r}", file=sys.stderr)
        self.req_client = None
        if self.zmq_ctx is not None:
            # term() blocks while a closed socket still has unsent messages
            # (default LINGER is infinite): never let that hang the worker.
            threading.Thread(target=self.zmq_ctx.term, daemon=True).start()
        self.zmq_ctx = None
        # Dropping the last reference to the SHM-backed storages unlinks
        # /dev/shm/lmcache_kv_<pid>_* (lmcache's weakref finalizers).
        self.kv_caches = None
        self.free_blocks = []
        gc.collect()

    def quit(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.transfer_ctx is not None:
            try:
                self.unregister(req)
            except Exception as exc:
                print(f"unregister on quit failed: {exc!r}", file=sys.stderr)
        raise WorkerExit({"kv_segments": _kv_segments()})

    def shutdown(self) -> None:
        if self.transfer_ctx is not None or self.req_client is not None:
            try:
                self.unregister({"timeout": 5.0})
            except Exception:
                self._release()


def main() -> int:
    engine = Engine()
    send(PROTO, ready_line("engine"))
    handlers = {
        "register": engine.register,
        "store": engine.store,
        "retrieve": engine.retrieve,
        "ping": engine.ping,
        "state": engine.state,
        "unregister": engine.unregister,
        "quit": engine.quit,
    }
    return serve(PROTO, handlers, on_exit=engine.shutdown)


if __name__ == "__main__":
    sys.exit(main())
