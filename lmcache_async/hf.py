"""Hugging Face ``transformers`` integration: a causal LM's KV cache in and out of LMCache.

Install with ``pip install 'lmcache-async[hf]'``; this module is imported only when used
(``import lmcache_async.hf``), never by ``import lmcache_async``.

Layouts (see ``docs/guides/transformers.md``):

* transformers keeps, per layer, ``key`` and ``value`` tensors ``[batch, kv_heads, T,
  head_dim]`` (a :class:`~transformers.DynamicCache`, or the legacy tuple of ``(key,
  value)`` pairs); RoPE is already applied to the keys.
* LMCache stores ``[2, L, T, D]`` with ``D = kv_heads * head_dim``, heads outermost:
  element ``[p, l, t, h * head_dim + d]`` is ``(key if p == 0 else value)[0, h, t, d]``
  of layer ``l``. That is the order vLLM's connector uses: its flash-attention cache
  ``[2, num_blocks, block_size, kv_heads, head_dim]`` flattened over the last two axes.

:func:`cache_to_kv` and :func:`kv_to_cache` convert both ways, bitwise. The engine-side
helpers run a model around an :class:`~lmcache_async.AsyncClient`:

* :func:`prefill_and_store`: run a prompt, store the whole chunks of its KV;
* :func:`generate_with_cache`: look the prompt up, retrieve the cached prefix, rebuild the
  model's cache from it, run only the uncached tail at positions that continue at the
  cached length, and decode greedily;
* :func:`store_cache`: store a cache the caller's own generation loop produced;
* :func:`compose_and_repair`: compose cached documents into a prompt (as
  :meth:`~lmcache_async.AsyncClient.compose`), recompute the first tokens of each
  document after the first over the composed KV in front of them, and store the result
  (the selective repair, which recomputes the tokens that matter most instead, is
  :mod:`lmcache_async.hf_blend`).

The model-only building blocks :func:`prefill` and :func:`generate` do no I/O; with the
blocking :class:`~lmcache_async.Client` the same flow is ``client.store(prefill(model,
tokens).kv, tokens)`` and ``generate(model, tokens, prefix_kv=client.retrieve(tokens))``.

Every argument is checked (batch 1, the model's geometry, dtype) before anything is sent.
Model computation runs on one worker thread of this module (:func:`run_model`), so the
event loop keeps serving other operations while a forward pass runs; forward passes run
one at a time (each already uses every core through torch's intra-op threads, and one
long-lived thread keeps torch's thread pool warm). It has no deadline of its own, and a
cancelled helper cannot stop a forward pass already running (its result is discarded).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lmcache_async._base.timeouts import DEFAULT, DefaultType, resolve_timeout
from lmcache_async._engine import compose as _compose, hf_recompute as _hf_recompute
from lmcache_async._engine.compose import ComposeResult, KVPart
from lmcache_async._protocol.wire import validate_cache_salt, validate_tokens
from lmcache_async.geometry import KVGeometry, dtype_from_name
from lmcache_async.rope import RopeSpec

try:
    from transformers import DynamicCache
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lmcache_async.hf needs the transformers package: pip install 'lmcache-async[hf]'"
    ) from _exc

if TYPE_CHECKING:
    from lmcache_async.client import AsyncClient

__all__ = [
    "ComposedPrompt",
    "Generation",
    "Prefill",
    "StoredPrompt",
    "cache_to_kv",
    "check_geometry",
    "compose_and_repair",
    "generate",
    "generate_with_cache",
    "geometry_from_config",
    "geometry_from_model",
    "kv_to_cache",
    "prefill",
    "prefill_and_store",
    "run_model",
    "store_cache",
]

T = TypeVar("T")

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- geometry


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def geometry_from_config(
    config: Any, *, dtype: torch.dtype | str | None = None, block_size: int = 16
) -> KVGeometry:
    """The :class:`~lmcache_async.KVGeometry` of a transformers model config.

    Args:
        config: a ``PretrainedConfig`` (``model.config``); for a multimodal model its text
            config is used.
        dtype: the KV dtype; default: the config's ``dtype`` (``torch_dtype``), else
            ``torch.float32`` (what transformers builds a model from a config in).
        block_size: the engine's paged block size the chunk size must be a multiple of
            (only checked against the server's chunk size; 16 as vLLM).

    Raises:
        ValueError: the model's cache is not one full-attention ``[batch, kv_heads, T,
            head_dim]`` tensor pair per layer (multi-head latent attention, sliding-window
            or other non-full-attention layers), or the config lacks the sizes.
    """
    cfg = _text_config(config)
    if getattr(cfg, "kv_lora_rank", None):
        raise ValueError("multi-head latent attention (kv_lora_rank) caches are not supported")
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        other = sorted({str(t) for t in layer_types if t != "full_attention"})
        if other:
            raise ValueError(
                f"only full-attention layers are supported; the config has {', '.join(other)} layers"
            )
    try:
        layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
    except (AttributeError, TypeError) as exc:
        raise ValueError(f"the config lacks num_hidden_layers/num_attention_heads: {exc}") from None
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
    if dtype is None:
        dtype = getattr(cfg, "dtype", None) or cfg.__dict__.get("torch_dtype") or torch.float32
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    return KVGeometry(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        dtype=dtype,
        block_size=block_size,
    )


def geometry_from_model(model: Any, *, block_size: int = 16) -> KVGeometry:
    """:func:`geometry_from_config` of ``model.config`` with the model's own dtype."""
    return geometry_from_config(model.config, dtype=_model_dtype(model), block_size=block_size)


def check_geometry(client_geometry: KVGeometry, model_geometry: KVGeometry) -> None:
    """Raise ``ValueError`` unless the two geometries describe the same KV layout
    (layers, KV heads, head size, dtype; the block size does not matter here)."""
    a, b = client_geometry, model_geometry
    if (a.num_layers, a.num_kv_heads, a.head_dim, a.dtype, a.use_mla) != (
        b.num_layers,
        b.num_kv_heads,
        b.head_dim,
        b.dtype,
        b.use_mla,
    ):
        raise ValueError(
            f"the client's geometry ({_describe(a)}) does not match the model's ({_describe(b)})"
        )


def _describe(g: KVGeometry) -> str:
    return f"{g.num_layers} layers, {g.num_kv_heads} KV heads x {g.head_dim}, {g.dtype}"


def _model_dtype(model: Any) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(iter(model.parameters())).dtype  # type: ignore[no-any-return]


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(iter(model.parameters())).device  # type: ignore[no-any-return]


def _cuda_device(model: Any) -> torch.device | None:
    """The model's device if it is a GPU (retrieves land there through the client's CUDA
    path, no host round trip), else ``None`` (the CPU: retrieves as before)."""
    device = _model_device(model)
    return device if device.type == "cuda" else None


# --------------------------------------------------------------------------- layouts


def _cache_layers(cache: Any) -> list[tuple[Any, Any]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56 Cache objects
        return [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in layers]
    if isinstance(cache, tuple | list) and all(isinstance(p, tuple | list) and len(p) >= 2 for p in cache):
        return [(p[0], p[1]) for p in cache]  # the legacy tuple of (key, value) pairs
    raise TypeError(
        f"cache must be a transformers Cache (e.g. DynamicCache) or a tuple of (key, value) "
        f"pairs, got {type(cache).__name__}"
    )


def cache_to_kv(cache: Any, geometry: KVGeometry) -> torch.Tensor:
    """The model's cache as LMCache's ``[2, L, T, D]`` tensor (a copy, on the cache's device).

    Args:
        cache: a transformers ``Cache`` (``DynamicCache``) or the legacy tuple of
            ``(key, value)`` pairs, one sequence (batch 1), per layer ``[1, kv_heads, T,
            head_dim]``.
        geometry: the KV layout the tensor must have (e.g. ``client.geometry``).

    Raises:
        TypeError: not a cache, or a dtype other than ``geometry.dtype``.
        ValueError: batch > 1, or a layer count, head count, head size or token count
            that does not fit ``geometry`` (a cache of another model).
    """
    if geometry.use_mla:
        raise ValueError("MLA geometries are not supported by the transformers integration")
    layers = _cache_layers(cache)
    if len(layers) != geometry.num_layers:
        raise ValueError(
            f"the cache has {len(layers)} layers, the geometry {geometry.num_layers} "
            "(a cache of another model?)"
        )
    want = (geometry.num_kv_heads, geometry.head_dim)
    tokens: int | None = None
    for i, (key, value) in enumerate(layers):
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"layer {i} has no {name} tensor (an empty or uninitialized cache?)")
            if t.dim() != 4:
                raise ValueError(
                    f"layer {i} {name} has shape {list(t.shape)}; expected [batch, kv_heads, T, head_dim]"
                )
            if t.shape[0] != 1:
                raise ValueError(
                    f"layer {i} {name} has batch size {t.shape[0]}; LMCache stores one sequence "
                    "per key: pass a batch-1 cache (one sequence)"
                )
            if (t.shape[1], t.shape[3]) != want:
                raise ValueError(
                    f"layer {i} {name} has {t.shape[1]} KV heads x {t.shape[3]}, the geometry "
                    f"{want[0]} x {want[1]} (a cache of another model?)"
                )
            if t.dtype != geometry.dtype:
                raise TypeError(f"layer {i} {name} has dtype {t.dtype}, the geometry says {geometry.dtype}")
            if tokens is None:
                tokens = t.shape[2]
            elif t.shape[2] != tokens:
                raise ValueError(f"layer {i} {name} holds {t.shape[2]} tokens, layer 0 key {tokens}")
    assert tokens is not None
    first = layers[0][0]
    out = torch.empty(geometry.kv_shape(tokens), dtype=geometry.dtype, device=first.device)
    h, hd = want
    for i, (key, value) in enumerate(layers):
        # [1, H, T, Hd] -> [T, H, Hd] -> the [T, H*Hd] row of layer i (heads outermost)
        out[0, i].view(tokens, h, hd).copy_(key[0].transpose(0, 1))
        out[1, i].view(tokens, h, hd).copy_(value[0].transpose(0, 1))
    return out


def kv_to_cache(kv: torch.Tensor, geometry: KVGeometry, *, config: Any = None, device: Any = None) -> Any:
    """A ``DynamicCache`` holding ``kv`` (``[2, L, T, D]``), per layer ``[1, kv_heads, T,
    head_dim]`` (copies: the cache never aliases ``kv``).

    Args:
        kv: LMCache's layout, e.g. what :meth:`AsyncClient.retrieve` returned.
        geometry: the layout ``kv`` must have (the model's).
        config: the model's config, so that the cache's layers match the model's layer
            types (recommended).
        device: where the cache lives (default: ``kv``'s device).

    Raises:
        TypeError: ``kv`` is not a tensor or has another dtype.
        ValueError: ``kv`` does not have the shape of ``geometry``.
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if geometry.use_mla:
        raise ValueError("MLA geometries are not supported by the transformers integration")
    if (
        kv.dim() != 4
        or kv.shape[0] != 2
        or kv.shape[1] != geometry.num_layers
        or kv.shape[3] != (geometry.hidden_dim)
    ):
        raise ValueError(
            f"kv has shape {list(kv.shape)}, expected {list(geometry.kv_shape(-1))} with T = tokens "
            f"({_describe(geometry)})"
        )
    if kv.dtype != geometry.dtype:
        raise TypeError(f"kv has dtype {kv.dtype}, the geometry says {geometry.dtype}")
    tokens = kv.shape[2]
    h, hd = geometry.num_kv_heads, geometry.head_dim
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    target = torch.device(device) if device is not None else kv.device
    if kv.device != target:
        kv = kv.to(target)  # one copy of the whole tensor, not one per layer and plane
    for i in range(geometry.num_layers):
        # [T, H*Hd] -> [1, H, T, Hd] as views; the cache's update copies them once
        key = kv[0, i].reshape(tokens, h, hd).transpose(0, 1).unsqueeze(0)
        value = kv[1, i].reshape(tokens, h, hd).transpose(0, 1).unsqueeze(0)
        cache.update(key, value, i)
    return cache


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True, slots=True)
class Prefill:
    """What :func:`prefill` computed.

    Attributes:
        kv: the prompt's KV, ``[2, L, T, D]`` (``T = len(tokens)``).
        logits: next-token logits after the prompt, ``[vocab]`` (float32).
        compute_ms: the forward pass, in milliseconds.
    """

    kv: torch.Tensor = field(repr=False)
    logits: torch.Tensor = field(repr=False)
    compute_ms: float


@dataclass(frozen=True, slots=True)
class StoredPrompt:
    """What :func:`prefill_and_store` did.

    Attributes:
        prompt_tokens: the prompt's length.
        stored_tokens: tokens whose KV LMCache now holds from this prompt (its whole chunks).
        stored_chunks: those whole chunks.
        stored_new: whether the store added a chunk (False: all were cached already).
        kv: the prompt's KV as the model computed it, ``[2, L, T, D]``.
        logits: next-token logits after the prompt.
        compute_ms: the forward pass; ``store_ms``: the store, in milliseconds.
    """

    prompt_tokens: int
    stored_tokens: int
    stored_new: bool
    kv: torch.Tensor = field(repr=False)
    logits: torch.Tensor = field(repr=False)
    compute_ms: float
    store_ms: float
    stored_chunks: int


@dataclass(frozen=True, slots=True)
class Generation:
    """What :func:`generate` / :func:`generate_with_cache` produced.

    Attributes:
        tokens: the generated token ids (greedy).
        prompt_tokens: the prompt's length.
        hit_tokens: the cached prefix LMCache returned (0 without a cache).
        reused_tokens: prompt tokens whose KV came from the cache: ``hit_tokens``, but at
            most ``prompt_tokens - 1`` (the last prompt token is always computed, for the
            next-token logits).
        computed_tokens: prompt tokens the model computed (``prompt_tokens - reused_tokens``),
            at positions ``reused_tokens .. prompt_tokens - 1``.
        logits: next-token logits after the prompt (float32).
        prompt_kv: with ``keep_kv=True``, the prompt's KV ``[2, L, T, D]`` as the model used
            it (cached prefix + computed tail); else ``None``.
        retrieve_ms, prefill_ms, decode_ms: latency of the retrieve (0 without a client),
            of the prompt's forward pass and of the decoding, in milliseconds.
    """

    tokens: list[int]
    prompt_tokens: int
    hit_tokens: int
    reused_tokens: int
    computed_tokens: int
    logits: torch.Tensor = field(repr=False)
    prompt_kv: torch.Tensor | None = field(default=None, repr=False)
    retrieve_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


_forward_params = _hf_recompute.forward_params


def _cache_kwarg(params: frozenset[str]) -> str:
    """``cache`` (recent transformers 5.x) or ``past_key_values`` (earlier)."""
    return "cache" if "cache" in params else "past_key_values"


def _forward(
    model: Any,
    ids: Sequence[int],
    cache: Any,
    start: int,
    *,
    positions: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``ids`` at positions ``start .. start + len(ids) - 1`` on ``cache`` (which must
    hold exactly ``start`` tokens and is extended in place); the last position's logits.

    With ``positions`` (``[len(ids)]``) and a 4D additive ``attention_mask`` (``[1, 1,
    len(ids), cached + len(ids)]``), the tokens run at those positions under that mask
    instead (the selective repair's scattered recomputation)."""
    device = _model_device(model)
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    if positions is None:
        pos = torch.arange(start, start + len(ids), dtype=torch.long, device=device).unsqueeze(0)
    else:
        pos = positions.to(device=device, dtype=torch.long).unsqueeze(0)
    params = _forward_params(type(model))
    kwargs: dict[str, Any] = {_cache_kwarg(params): cache, "position_ids": pos, "use_cache": True}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    if "cache_position" in params:  # transformers 4.x derives masks from it
        kwargs["cache_position"] = torch.arange(start, start + len(ids), dtype=torch.long, device=device)
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    with torch.no_grad():
        out = model(input_ids=input_ids, **kwargs)
    return out.logits[0, -1].float()  # type: ignore[no-any-return]


def _greedy(
    model: Any, cache: Any, logits: torch.Tensor, start: int, n: int, eos_token_id: int | None
) -> list[int]:
    new: list[int] = []
    for i in range(n):
        token = int(logits.argmax())
        new.append(token)
        if token == eos_token_id or i == n - 1:
            break
        logits = _forward(model, [token], cache, start + i)
    return new


def _prompt(tokens: Sequence[int], model: Any) -> list[int]:
    toks = validate_tokens(tokens)
    if not toks:
        raise ValueError("tokens must not be empty")
    vocab = getattr(_text_config(model.config), "vocab_size", None)
    if isinstance(vocab, int) and max(toks) >= vocab:
        raise ValueError(f"token id {max(toks)} is outside the model's vocabulary of {vocab} ids")
    return toks


def _check_new_tokens(max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")


def prefill(model: Any, tokens: Sequence[int]) -> Prefill:
    """Run the whole prompt through ``model`` (no I/O): its KV and next-token logits.

    Raises:
        ValueError/TypeError: empty or invalid ``tokens``; a model whose cache layout is
            not supported (see :func:`geometry_from_config`).
    """
    toks = _prompt(tokens, model)
    geometry = geometry_from_model(model)
    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    logits = _forward(model, toks, cache, 0)
    kv = cache_to_kv(cache, geometry)
    return Prefill(kv=kv, logits=logits, compute_ms=_ms(t0))


def generate(
    model: Any,
    tokens: Sequence[int],
    *,
    max_new_tokens: int = 16,
    prefix_kv: torch.Tensor | None = None,
    keep_kv: bool = False,
    eos_token_id: int | None = None,
) -> Generation:
    """Greedy generation after ``tokens``, reusing ``prefix_kv`` for the prompt's prefix.

    Args:
        model: a transformers causal LM (batch 1; any device).
        tokens: the prompt.
        max_new_tokens: tokens to generate (the first comes from the prompt's logits).
        prefix_kv: the KV of ``tokens[:T]`` (``[2, L, T, D]``, ``T <= len(tokens)``), e.g.
            an LMCache retrieve; ``None``: compute the whole prompt. At most
            ``len(tokens) - 1`` of its tokens are used, so that the last prompt token is
            computed and gives the next-token logits.
        keep_kv: also return the prompt's KV (:attr:`Generation.prompt_kv`).
        eos_token_id: stop after generating this token.

    The uncached tail runs at positions ``T' .. len(tokens) - 1`` (``T'`` = tokens reused),
    exactly where a full prefill computes it.

    Raises:
        ValueError/TypeError: bad arguments, or a ``prefix_kv`` of another geometry or
            dtype than the model's, or longer than the prompt.
    """
    toks = _prompt(tokens, model)
    _check_new_tokens(max_new_tokens)
    geometry = geometry_from_model(model)
    hit = 0
    if prefix_kv is not None:
        if not isinstance(prefix_kv, torch.Tensor):
            raise TypeError(f"prefix_kv must be a torch.Tensor, got {type(prefix_kv).__name__}")
        if prefix_kv.dim() == 4 and prefix_kv.shape[2] > len(toks):
            raise ValueError(f"prefix_kv covers {prefix_kv.shape[2]} tokens, the prompt has {len(toks)}")
        hit = prefix_kv.shape[2] if prefix_kv.dim() == 4 else 0
    reused = min(hit, len(toks) - 1)
    t0 = time.perf_counter()
    if prefix_kv is not None:
        cache = kv_to_cache(
            prefix_kv[:, :, :reused], geometry, config=model.config, device=_model_device(model)
        )
    else:
        cache = DynamicCache(config=model.config)
    logits = _forward(model, toks[reused:], cache, reused)
    prefill_ms = _ms(t0)
    prompt_kv = cache_to_kv(cache, geometry) if keep_kv else None
    t1 = time.perf_counter()
    new = _greedy(model, cache, logits, len(toks), max_new_tokens, eos_token_id)
    return Generation(
        tokens=new,
        prompt_tokens=len(toks),
        hit_tokens=hit,
        reused_tokens=reused,
        computed_tokens=len(toks) - reused,
        logits=logits,
        prompt_kv=prompt_kv,
        prefill_ms=prefill_ms,
        decode_ms=_ms(t1),
    )


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


# --------------------------------------------------------------------------- with a client

_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


async def run_model(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` (model computation) on this module's model thread.

    One thread, created on first use, runs every call in turn: the event loop is not
    blocked, and torch's intra-op thread pool, which belongs to the calling thread, is
    built once (a fresh thread pays for it again on its first forward pass).

    Cancellation: the caller stops waiting; a call already running finishes on the
    thread and its result is dropped; one not started yet is not run.
    """
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-hf-model")
        executor = _EXECUTOR
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, functools.partial(fn, *args, **kwargs))


async def prefill_and_store(
    client: AsyncClient,
    model: Any,
    tokens: Sequence[int],
    cache_salt: str = "",
    *,
    timeout: float | DefaultType | None = DEFAULT,
) -> StoredPrompt:
    """Run the prompt through ``model`` and store the whole chunks of its KV in LMCache.

    The client's geometry must be the model's (:func:`geometry_from_model`); this is
    checked, with the tokens and the salt, before anything is computed or sent.

    Raises:
        ValueError/TypeError: bad arguments, or a client of another geometry.
        LMCacheTimeoutError: the store had no answer within ``timeout`` (the client's
            default when omitted); the forward pass has no deadline.

    Cancellation/timeout: as :meth:`AsyncClient.store` once the store began; a forward
    pass already running in its worker thread finishes and its result is dropped.
    """
    toks = _prompt(tokens, model)
    validate_cache_salt(cache_salt)
    check_geometry(client.geometry, geometry_from_model(model))
    pre = await run_model(prefill, model, toks)
    t0 = time.perf_counter()
    new = await client.store(pre.kv, toks, cache_salt, timeout=timeout)
    cs = client.chunk_size
    stored = len(toks) // cs * cs
    return StoredPrompt(
        prompt_tokens=len(toks),
        stored_tokens=stored,
        stored_new=new,
        kv=pre.kv,
        logits=pre.logits,
        compute_ms=pre.compute_ms,
        store_ms=_ms(t0),
        stored_chunks=stored // cs,
    )


async def generate_with_cache(
    client: AsyncClient,
    model: Any,
    tokens: Sequence[int],
    cache_salt: str = "",
    *,
    max_new_tokens: int = 16,
    keep_kv: bool = False,
    eos_token_id: int | None = None,
    timeout: float | DefaultType | None = DEFAULT,
) -> Generation:
    """Serve ``tokens`` from LMCache: retrieve the cached prefix, rebuild the model's cache
    from it, compute only the uncached tail (at the positions that follow the prefix) and
    decode greedily (see :func:`generate`).

    Raises:
        ValueError/TypeError: bad arguments, or a client of another geometry than the
            model's (checked before anything is sent).
        LMCacheTimeoutError: the retrieve had no answer within ``timeout``; model
            computation has no deadline.

    Cancellation/timeout: as :meth:`AsyncClient.retrieve` during the retrieve; once the
    model runs (in a worker thread) it finishes and its result is dropped.
    """
    toks = _prompt(tokens, model)
    validate_cache_salt(cache_salt)
    _check_new_tokens(max_new_tokens)
    check_geometry(client.geometry, geometry_from_model(model))
    t0 = time.perf_counter()
    kv = await client.retrieve(toks, cache_salt, device=_cuda_device(model), timeout=timeout)
    retrieve_ms = _ms(t0)

    def run() -> Generation:
        return generate(
            model,
            toks,
            max_new_tokens=max_new_tokens,
            prefix_kv=kv,
            keep_kv=keep_kv,
            eos_token_id=eos_token_id,
        )

    result = await run_model(run)
    return replace(result, retrieve_ms=retrieve_ms)


async def store_cache(
    client: AsyncClient,
    cache: Any,
    tokens: Sequence[int],
    cache_salt: str = "",
    *,
    timeout: float | DefaultType | None = DEFAULT,
) -> bool:
    """Store a transformers cache (batch 1) under ``tokens`` (:meth:`AsyncClient.store`).

    ``tokens`` may be longer than the cache (e.g. a sequence whose last generated token
    has no KV yet): the KV is stored under ``tokens[:T]``.

    Raises:
        ValueError/TypeError: batch > 1, another geometry or dtype than the client's,
            fewer tokens than the cache holds (all before anything is sent).
        LMCacheTimeoutError: no answer within ``timeout``.

    Cancellation/timeout: as :meth:`AsyncClient.store`.
    """
    toks = validate_tokens(tokens)
    validate_cache_salt(cache_salt)
    kv = cache_to_kv(cache, client.geometry)
    return await client.store(kv, toks, cache_salt, timeout=timeout)


@dataclass(frozen=True, slots=True)
class ComposedPrompt:
    """What :func:`compose_and_repair` or :func:`compose_and_blend` did.

    Attributes:
        result: the composition's :class:`~lmcache_async.ComposeResult` (per part its
            offset, shift and hit; the tokens stored). With ``stored`` set, its
            ``stored_new`` is False: the store's answer is ``await stored``.
        recomputed_tokens: tokens whose KV the model recomputed (0 on a miss).
        kv: the target KV (what is stored), ``[2, L, stored, D]`` on the model's device
            (``None`` on a miss).
        compute_ms: the model's work (selection and recomputation), in milliseconds.
        recomputed_positions: the target positions whose KV was recomputed, ascending
            (the first-k repair's spans, or the tokens the selective repair chose).
        retrieve_ms: the parts' retrieves and their placement; ``store_ms``: the store
            (0 while it runs in the background).
        generation: with ``max_new_tokens > 0``, the target served from the composed KV
            (:class:`Generation`; its ``retrieve_ms`` is the parts' retrieves); else
            ``None``.
        stored: with ``max_new_tokens > 0`` and every part hit, the target's store, still
            running when the call returned: ``await stored`` gives ``stored_new`` or
            raises the store's error (an error nobody awaits is logged); else ``None``.
    """

    result: ComposeResult
    recomputed_tokens: int
    kv: torch.Tensor | None = field(repr=False)
    compute_ms: float
    recomputed_positions: tuple[int, ...] = field(default=(), repr=False)
    retrieve_ms: float = 0.0
    store_ms: float = 0.0
    generation: Generation | None = field(default=None, repr=False)
    stored: asyncio.Future[bool] | None = field(default=None, repr=False)


#: ``repair(plan, kv, tokens)``: the model's work on the composed KV (in place, on the
#: model thread); returns the positions it recomputed.
_Repair = Callable[["_compose.Plan", torch.Tensor, list[int]], list[int]]


@dataclass(frozen=True, slots=True)
class _Serve:
    """What to generate from the composed KV (``max_new_tokens > 0``)."""

    max_new_tokens: int
    eos_token_id: int | None


def _log_store_error(task: asyncio.Future[bool]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("the composed target's background store failed: %r", exc)


async def _compose_repair_store(
    client: AsyncClient,
    model: Any,
    toks: list[int],
    parts: Sequence[KVPart],
    rope: RopeSpec | None,
    cache_salt: str,
    timeout: float | DefaultType | None,
    repair: _Repair | None,
    check: Callable[[_compose.Plan], None] | None = None,
    serve: _Serve | None = None,
) -> ComposedPrompt:
    """The composition around a repair: check (nothing sent; ``check`` on the plan, the
    repair's own), retrieve and place the parts on the model's device, run ``repair`` on
    the model thread, store the result whole; with ``serve``, the target's tokens are
    generated from the composed KV while the store runs (it is returned unfinished)."""
    geometry = geometry_from_model(model)
    check_geometry(client.geometry, geometry)
    if rope is None:
        rope = RopeSpec.from_hf_config(model.config)
    deadline = resolve_timeout(timeout, client.timeout)
    the_plan = _compose.plan(toks, parts, rope, cache_salt, client.geometry, client.chunk_size)
    if check is not None:
        check(the_plan)
    t0 = time.perf_counter()
    device = _cuda_device(model)
    kv = torch.empty(client.geometry.kv_shape(the_plan.stored), dtype=client.geometry.dtype, device=device)
    gathered = await _compose.gather(client, the_plan, deadline, kv)
    if not all(gathered.hits(the_plan)) or not the_plan.stored:
        return ComposedPrompt(_compose.result(the_plan, gathered, False), 0, None, 0.0)
    _compose.assemble(the_plan, gathered.kvs, client.geometry, kv, gathered.in_place)
    gathered.kvs.clear()
    retrieve_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    positions = await run_model(repair, the_plan, kv, toks) if repair is not None else []
    compute_ms = _ms(t1)
    left = None if deadline is None else max(deadline - retrieve_s, 0.0)  # the model's time has no deadline
    t2 = time.perf_counter()
    store = asyncio.ensure_future(client.store(kv, toks[: the_plan.stored], cache_salt, timeout=left))
    gen: Generation | None = None
    if serve is not None:
        try:
            gen = await run_model(
                generate,
                model,
                toks,
                max_new_tokens=serve.max_new_tokens,
                prefix_kv=kv,
                eos_token_id=serve.eos_token_id,
            )
        except BaseException:
            store.cancel()  # a store cancelled cleanly stores all chunks or none
            raise
        store.add_done_callback(_log_store_error)
    new = False if gen is not None else await store
    return ComposedPrompt(
        _compose.result(the_plan, gathered, new),
        len(positions),
        kv,
        compute_ms,
        tuple(positions),
        retrieve_s * 1000.0,
        0.0 if gen is not None else _ms(t2),
        None if gen is None else replace(gen, retrieve_ms=retrieve_s * 1000.0),
        None if gen is None else store,
    )


def _recompute_at(model: Any, toks: list[int], kv: torch.Tensor, chosen: list[int]) -> None:
    """Recompute the KV of the tokens at ``chosen`` (ascending) over ``kv`` in one pass,
    in place: each attends to the KV in ``kv`` of the tokens before it that are not
    chosen and to the recomputed KV of the chosen ones up to itself (the repairs' one
    scattered forward pass)."""
    geometry = geometry_from_model(model)
    if _hf_recompute.usable(model, kv):  # on a GPU: in place, attention cut by position
        ids = [toks[i] for i in chosen]
        _hf_recompute.run(model, kv, ids, chosen, geometry.num_kv_heads, geometry.head_dim)
        return
    device = _model_device(model)
    total = kv.shape[2]
    pos = torch.tensor(chosen, dtype=torch.long, device=device)
    is_chosen = torch.zeros(total, dtype=torch.bool, device=device)
    is_chosen[pos] = True
    cached = torch.arange(total, device=device)
    allowed = torch.cat(
        [
            (cached.unsqueeze(0) < pos.unsqueeze(1)) & ~is_chosen.unsqueeze(0),  # composed, before
            pos.unsqueeze(0) <= pos.unsqueeze(1),  # recomputed, causal
        ],
        dim=1,
    )
    dtype = _model_dtype(model)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    cache = kv_to_cache(kv, geometry, config=model.config, device=device)
    _forward(
        model,
        [toks[i] for i in chosen],
        cache,
        total,
        positions=pos,
        attention_mask=mask.unsqueeze(0).unsqueeze(0),
    )
    n = len(chosen)
    at = pos.to(kv.device)
    for i, (key, value) in enumerate(_cache_layers(cache)):  # only the recomputed tokens
        kv[0, i, at] = key[0, :, total:].transpose(0, 1).reshape(n, -1).to(kv.device)
        kv[1, i, at] = value[0, :, total:].transpose(0, 1).reshape(n, -1).to(kv.device)


async def compose_and_repair(
    client: AsyncClient,
    model: Any,
    target_tokens: Sequence[int],
    parts: Sequence[KVPart],
    *,
    recompute: int = 0,
    rope: RopeSpec | None = None,
    cache_salt: str = "",
    max_new_tokens: int = 0,
    eos_token_id: int | None = None,
    timeout: float | DefaultType | None = DEFAULT,
) -> ComposedPrompt:
    """Compose cached documents into ``target_tokens`` and repair their boundaries with
    the model, then store the target (the first-k repair, as EPIC's).

    A document cached on its own holds KV computed without the text in front of it in
    the target; its first tokens differ most from a full prefill's. This takes the
    parts' KV from the cache and places it as :meth:`AsyncClient.compose
    <lmcache_async.AsyncClient.compose>` does (shifted keys rotated with ``rope``), then,
    recomputes the first ``recompute`` tokens of each part after the first with the model
    in one pass, each over the composed KV in front of it (the earlier parts' first tokens
    already repaired), replaces their KV, and stores the target's whole chunks. ``recompute=0`` is plain
    composition. On a trained model this is not enough to keep the answers (see
    :func:`compose_and_blend` and the KV-editing guide's table).

    Args:
        client: an open client with the model's geometry.
        model: the transformers causal LM whose KV the cache holds.
        target_tokens: the prompt to store (the parts fill its beginning).
        parts: :class:`~lmcache_async.KVPart` ranges, in order.
        recompute: tokens recomputed at the start of each part after the first (>= 0).
        rope: the model's rotary embedding (default: ``RopeSpec.from_hf_config(model.config)``).
        cache_salt: the target's namespace and the parts' default.
        max_new_tokens: with ``> 0``, also serve the target: its tokens after the stored
            chunks run over the composed KV and ``max_new_tokens`` tokens are generated
            greedily (:attr:`ComposedPrompt.generation`), while the target's store runs
            beside them; the call returns without waiting for the store
            (:attr:`ComposedPrompt.stored`). 0 (default): nothing is generated and the
            call returns once the target is stored.
        eos_token_id: stop generating after this token.
        timeout: one deadline for the retrieves and the store (default: the client's);
            the model's computation has none.

    Returns:
        A :class:`ComposedPrompt`. On a miss of any part nothing is computed or stored
        and ``result.missed`` names the parts.

    Where it runs: on the model's device. With a model on a GPU the parts are retrieved
    straight into GPU memory (the client's CUDA path), rotated and repaired there, and
    the target is stored from there; the CPU is not a staging area.

    Raises:
        ValueError/TypeError: bad arguments, a client of another geometry than the
            model's, a RoPE kind that cannot be shifted (all before anything is sent).
        LMCacheTimeoutError: no answer within ``timeout``.

    Cancellation/timeout: during the retrieves nothing is stored; a recomputation
    already running in the model thread finishes and is dropped; during the store, as
    :meth:`AsyncClient.store`. With ``max_new_tokens``, a cancellation while the tokens
    are generated cancels the store too (all chunks or none are stored); once returned,
    the store is an operation of the client: ``aclose()`` waits for it (at most
    ``cleanup_grace``) or cancels it, all chunks or none. Do not write to
    :attr:`ComposedPrompt.kv` before ``stored`` is done.
    """
    toks = _prompt(target_tokens, model)
    if isinstance(recompute, bool) or not isinstance(recompute, int) or recompute < 0:
        raise ValueError(f"recompute must be an int >= 0, got {recompute!r}")
    _check_new_tokens(max_new_tokens)
    geometry_from_model(model)  # a model without a KV geometry is refused before sending

    def repair(the_plan: _compose.Plan, kv: torch.Tensor, toks: list[int]) -> list[int]:
        spans = [(p.offset, p.offset + min(recompute, p.placed)) for p in the_plan.placements[1:] if p.placed]
        chosen = [t for a, b in spans for t in range(a, b)]
        if chosen:
            _recompute_at(model, toks, kv, chosen)
        return chosen

    return await _compose_repair_store(
        client,
        model,
        toks,
        parts,
        rope,
        cache_salt,
        timeout,
        repair if recompute else None,
        serve=_Serve(max_new_tokens, eos_token_id) if max_new_tokens else None,
    )
