"""Ray Data integration: bulk remaps as a ``Dataset.map_batches`` stage over an actor pool.

Install with ``pip install 'lmcache-async[ray]'``; this module is imported only when used
(``import lmcache_async.ray``), never by ``import lmcache_async``, and it is the only one
that imports ``ray``.

* :class:`RemapBatches` is the callable class for ``map_batches(RemapBatches,
  compute=ray.data.ActorPoolStrategy(size=N), ...)``: each actor opens one blocking
  :class:`~lmcache_async.Client` (one :class:`~lmcache_async.AsyncClient` on the
  process's private event-loop thread) when it starts, keeps it for its whole life, and
  runs each batch with :meth:`~lmcache_async.Client.remap_many` (bounded concurrency and
  memory). It returns one row per pair (:data:`OUTPUT_COLUMNS`).
* :func:`remap_dataset` wires it up (actor pool, batch size, constructor arguments).
* :func:`skip_done` drops the pairs an earlier run's output shows done: a job resumes
  from its own output dataset.

Input rows: ``source`` and ``target`` (lists of token ids), optionally ``cache_salt``
and ``target_cache_salt`` (strings; a null target salt means "same as the source") and
``id`` (any value, copied to the output row). The row's ``key`` is the pair's identity,
the same key ``lmcache-async remap-batch`` reports, shards and resumes by.

Where an actor's server is: ``servers`` maps a node's IP address (Ray's
``ray.util.get_node_ip_address()`` in the actor) to ``(url, http_url)``; without it the
actor reads ``LMCACHE_ASYNC_URL`` and ``LMCACHE_ASYNC_HTTP_URL`` from its environment
(set them on each node, or in ``runtime_env``). Keeping actors on the hosts that run a
server is Ray's scheduling: see ``docs/guides/deployment.md``.

A batch retried after its actor died (Ray Data restarts the actor and retries the batch)
remaps again the pairs the dead actor had finished: a remap is idempotent on the server
(the store of KV already there adds nothing), and the retried rows say so
(``already_cached``). The retry redoes every pair of the batch, so a pair the dead actor
left unfinished is stored in full by it. The batch's rows are emitted only when the batch
completes: the output holds each pair once.

Timeouts: each pair has the client's ``timeout`` (``client_options``); a pair that runs
past it is a row with ``error_type`` ``LMCacheTimeoutError``, not a failed batch. A batch
has no deadline of its own (every pair is bounded). Cancellation: cancelling the Ray job
kills the actors; each pair in flight is then released on the server by its own expiry.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from lmcache_async._base.pair_key import pair_key
from lmcache_async.bulk import RemapPair
from lmcache_async.client import ClientOptions
from lmcache_async.sync_client import Client

try:
    import pyarrow as pa
    import ray
    import ray.data
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError("lmcache_async.ray needs Ray Data: pip install 'lmcache-async[ray]'") from _exc

if TYPE_CHECKING:
    from ray.data import Dataset

__all__ = [
    "ACTOR_CPUS",
    "HTTP_URL_ENV",
    "OUTPUT_COLUMNS",
    "URL_ENV",
    "RemapBatches",
    "done_keys",
    "remap_dataset",
    "server_for_node",
    "skip_done",
]

#: The environment variables an actor reads its server from when no ``servers`` mapping
#: is given.
URL_ENV: Final = "LMCACHE_ASYNC_URL"
HTTP_URL_ENV: Final = "LMCACHE_ASYNC_HTTP_URL"

# The output table's columns and types; OUTPUT_COLUMNS (below) documents them.
_SCHEMA: Final = pa.schema(
    [
        ("key", pa.string()),
        ("id", pa.string()),
        ("status", pa.string()),
        ("retrieved_tokens", pa.int64()),
        ("stored_tokens", pa.int64()),
        ("bytes", pa.int64()),
        ("stored_new", pa.bool_()),
        ("already_cached", pa.bool_()),
        ("error_type", pa.string()),
        ("error", pa.string()),
        ("server", pa.string()),
    ]
)
#: The output schema, one row per input pair:
#:
#: * ``key``: the pair's identity (as ``remap-batch --report``);
#: * ``id``: the input's ``id`` (null when the input has none);
#: * ``status``: ``"hit"`` (the source's KV was found and stored under the target),
#:   ``"miss"`` (nothing to remap) or ``"error"`` (a pair with an empty source, or a
#:   target shorter than one chunk, is an ``error`` whose text starts ``invalid pair``, as
#:   in ``remap-batch``: nothing could ever be stored for it, so a resume retries it);
#: * ``retrieved_tokens`` / ``stored_tokens``: tokens moved;
#: * ``bytes``: bytes moved (retrieved + stored tokens, times the bytes per token);
#: * ``stored_new``: the store added at least one chunk;
#: * ``already_cached``: a hit whose target was entirely on the server already (a retried
#:   batch, a rerun, or a duplicate pair);
#: * ``error_type`` / ``error``: the exception's class name and message (null on success);
#: * ``server``: the ZMQ URL of the server the pair went to.
OUTPUT_COLUMNS: Final[tuple[str, ...]] = tuple(_SCHEMA.names)
_DONE: Final = ("hit", "miss")

#: The CPUs each actor asks Ray for by default: an actor mostly waits for its server, and
#: the stages before and after it (reading the pairs, writing the rows) need CPUs of their
#: own -- with 1 CPU per actor, 2 actors on a 2-CPU node leave none for the read, and the
#: job stalls.
ACTOR_CPUS: Final = 0.5


def server_for_node(
    node_ip: str,
    servers: Mapping[str, tuple[str, str]] | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, str]:
    """The ``(url, http_url)`` of the LMCache server of the node at ``node_ip``.

    Args:
        node_ip: the node's IP address as Ray gives it.
        servers: node IP -> ``(url, http_url)``; when given, the node must be in it.
        env: where ``LMCACHE_ASYNC_URL`` / ``LMCACHE_ASYNC_HTTP_URL`` are read when
            ``servers`` is None (default ``os.environ``).

    Raises:
        ValueError: the node is not in ``servers``, or the variables are not set.
    """
    if servers is not None:
        try:
            url, http_url = servers[node_ip]
        except KeyError:
            raise ValueError(
                f"no LMCache server is given for node {node_ip} (servers has {sorted(servers)})"
            ) from None
        return url, http_url
    env = os.environ if env is None else env
    url, http_url = env.get(URL_ENV, ""), env.get(HTTP_URL_ENV, "")
    if not url or not http_url:
        raise ValueError(
            f"node {node_ip}: set {URL_ENV} and {HTTP_URL_ENV} to its LMCache server's URLs "
            "(or pass servers={node_ip: (url, http_url)})"
        )
    return url, http_url


def _tokens(value: Any) -> Any:
    """Token ids from an Arrow/numpy cell: a Python list of ints (anything else is left
    for :class:`~lmcache_async.RemapPair` to refuse)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _salt(value: Any, default: str | None) -> Any:
    return default if value is None else value


def _check_sizes(pair: RemapPair, chunk_size: int) -> None:
    """Refuse a pair for which nothing can ever be stored (``invalid pair: ...``)."""
    if not pair.source_tokens:
        raise ValueError("invalid pair: the source is empty")
    if len(pair.target_tokens) < chunk_size:
        raise ValueError(
            f"invalid pair: the target has {len(pair.target_tokens)} tokens, fewer than one "
            f"chunk ({chunk_size}): nothing would be stored"
        )


def _column(batch: Mapping[str, Any], name: str, n: int) -> Sequence[Any]:
    col = batch.get(name)
    return [None] * n if col is None else col


class RemapBatches:
    """The ``map_batches`` callable class: one client per actor, one row per pair.

    Constructed once per actor (Ray passes ``fn_constructor_kwargs``): it finds the node's
    server (:func:`server_for_node`) and connects; a server that cannot be reached fails
    the actor's start (Ray retries it). Each call remaps one batch with ``remap_many``.
    The client is closed when the actor's process exits (its finalizer).

    Args:
        model_name: the model the KV belongs to.
        servers: node IP -> ``(url, http_url)``; None: ``LMCACHE_ASYNC_URL`` /
            ``LMCACHE_ASYNC_HTTP_URL`` from the actor's environment.
        concurrency: pairs in flight per actor.
        max_bytes_in_flight: memory budget per actor for KV buffers.
        client_options: keyword arguments of :class:`~lmcache_async.AsyncClient`
            (``geometry``, ``timeout``, ...).
        node_ip: the node's address; None asks Ray (tests pass it).

    Raises (constructor): as :class:`~lmcache_async.Client`; ``ValueError`` from
    :func:`server_for_node`.
    """

    def __init__(
        self,
        model_name: str,
        *,
        servers: Mapping[str, tuple[str, str]] | None = None,
        concurrency: int = 8,
        max_bytes_in_flight: int = 1 << 30,
        client_options: ClientOptions | None = None,
        node_ip: str | None = None,
    ) -> None:
        node = ray.util.get_node_ip_address() if node_ip is None else node_ip
        self.url, http_url = server_for_node(node, servers)
        self.concurrency = concurrency
        self.max_bytes_in_flight = max_bytes_in_flight
        self.client = Client(self.url, http_url, model_name, **(client_options or {}))
        self.bytes_per_token = self.client.geometry.bytes_per_token

    def __call__(self, batch: Mapping[str, Any]) -> pa.Table:
        """Remap the batch's pairs; one output row per input row, in input order.

        A row that is not a valid pair is an ``error`` row (``error_type`` ``TypeError``
        or ``ValueError``; an empty source or a target shorter than one chunk: a
        ``ValueError`` whose text starts ``invalid pair``), the others still run. Blocks
        until every pair has finished (each is bounded by the client's ``timeout``).
        """
        sources = batch["source"]
        n = len(sources)
        targets = batch["target"]
        salts = _column(batch, "cache_salt", n)
        tsalts = _column(batch, "target_cache_salt", n)
        ids = _column(batch, "id", n)
        rows: list[dict[str, Any]] = []
        pairs: list[RemapPair] = []
        where: list[int] = []
        for i in range(n):
            src, dst = _tokens(sources[i]), _tokens(targets[i])
            salt, tsalt = _salt(salts[i], ""), _salt(tsalts[i], None)
            row: dict[str, Any] = {
                "key": pair_key(src, dst, salt, tsalt),
                "id": None if ids[i] is None else str(ids[i]),
                "status": "error",
                "retrieved_tokens": 0,
                "stored_tokens": 0,
                "bytes": 0,
                "stored_new": False,
                "already_cached": False,
                "error_type": None,
                "error": None,
                "server": self.url,
            }
            rows.append(row)
            try:
                pair = RemapPair(src, dst, salt, tsalt)
                _check_sizes(pair, self.client.chunk_size)
            except (TypeError, ValueError) as exc:
                row["error_type"], row["error"] = type(exc).__name__, str(exc)
                continue
            pairs.append(pair)
            where.append(i)
        if pairs:
            result = self.client.remap_many(
                pairs, concurrency=self.concurrency, max_bytes_in_flight=self.max_bytes_in_flight
            )
            for i, item in zip(where, result, strict=True):
                row = rows[i]
                if item.error is not None:
                    row["error_type"], row["error"] = type(item.error).__name__, str(item.error)
                    continue
                row["status"] = "hit" if item.hit else "miss"
                row["retrieved_tokens"] = item.retrieved_tokens
                row["stored_tokens"] = item.stored_tokens
                row["bytes"] = (item.retrieved_tokens + item.stored_tokens) * self.bytes_per_token
                row["stored_new"] = item.stored_new
                row["already_cached"] = item.hit and not item.stored_new
        return pa.Table.from_pylist(rows, schema=_SCHEMA)


def remap_dataset(
    pairs: Dataset,
    model_name: str,
    *,
    actors: int = 2,
    batch_size: int = 256,
    servers: Mapping[str, tuple[str, str]] | None = None,
    concurrency: int = 8,
    max_bytes_in_flight: int = 1 << 30,
    client_options: ClientOptions | None = None,
    batch_class: type[RemapBatches] | None = None,
    **map_batches_args: Any,
) -> Dataset:
    """``pairs`` remapped by a fixed pool of ``actors`` :class:`RemapBatches` actors.

    Lazy, as every Ray Data transform: nothing runs until the result is consumed
    (``write_parquet``, ``take_all``, ``iter_batches``...).

    Args:
        pairs: rows with ``source``, ``target`` (and optionally ``cache_salt``,
            ``target_cache_salt``, ``id``).
        model_name: as :class:`RemapBatches`.
        servers: as :class:`RemapBatches`.
        concurrency: as :class:`RemapBatches`.
        max_bytes_in_flight: as :class:`RemapBatches`.
        client_options: as :class:`RemapBatches`.
        actors: actors in the pool (``ActorPoolStrategy(size=actors)``), e.g. one per
            node running a server.
        batch_size: pairs per ``remap_many`` call.
        batch_class: a subclass of :class:`RemapBatches` to run instead (same constructor
            arguments), e.g. one that adds columns.
        map_batches_args: more keyword arguments of ``Dataset.map_batches`` (``num_cpus``,
            default :data:`ACTOR_CPUS`; ``resources``, ``label_selector``,
            ``scheduling_strategy``...).
    """
    kwargs: dict[str, Any] = {
        "model_name": model_name,
        "servers": None if servers is None else dict(servers),
        "concurrency": concurrency,
        "max_bytes_in_flight": max_bytes_in_flight,
        "client_options": None if client_options is None else dict(client_options),
    }
    map_batches_args.setdefault("num_cpus", ACTOR_CPUS)
    return pairs.map_batches(
        RemapBatches if batch_class is None else batch_class,
        fn_constructor_kwargs=kwargs,
        compute=ray.data.ActorPoolStrategy(size=actors),
        batch_size=batch_size,
        batch_format="numpy",
        **map_batches_args,
    )


def done_keys(output: Dataset | Iterable[Mapping[str, Any]]) -> set[str]:
    """Keys of the pairs an output (a dataset, or its rows) shows done: ``hit`` or
    ``miss`` (``error`` rows are redone)."""
    if isinstance(output, ray.data.Dataset):
        rows: Iterable[Mapping[str, Any]] = output.select_columns(["key", "status"]).iter_rows()
    else:
        rows = output
    return {str(row["key"]) for row in rows if row["status"] in _DONE}


def _drop(keys: set[str]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def drop(batch: dict[str, Any]) -> dict[str, Any]:
        n = len(batch["source"])
        salts = _column(batch, "cache_salt", n)
        tsalts = _column(batch, "target_cache_salt", n)
        keep = np.array(
            [
                pair_key(
                    _tokens(batch["source"][i]),
                    _tokens(batch["target"][i]),
                    _salt(salts[i], ""),
                    _salt(tsalts[i], None),
                )
                not in keys
                for i in range(n)
            ],
            dtype=bool,
        )
        return {name: column[keep] for name, column in batch.items()}

    return drop


def skip_done(pairs: Dataset, output: Dataset | Iterable[Mapping[str, Any]]) -> Dataset:
    """``pairs`` without the pairs ``output`` (an earlier run's output rows) shows done.

    The done keys are read at once (a set of 20-character strings, about 100 bytes per
    pair); the filter is lazy. Resume a job with ``remap_dataset(skip_done(pairs,
    ray.data.read_parquet(previous_output)), ...)`` and write to a new directory.
    """
    keys = done_keys(output)
    if not keys:
        return pairs
    return pairs.map_batches(_drop(keys), batch_format="numpy", batch_size=4096)
