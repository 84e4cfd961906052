"""The selective repair of composed prompts (CacheBlend's idea) on a transformers model.

:func:`compose_and_blend` composes cached documents into a prompt (as
:meth:`~lmcache_async.AsyncClient.compose`), then recomputes, in each document after the
first, the share ``recompute_fraction`` of its tokens that matter most, attending over the
composed KV in front of them, and stores the result; :func:`select_and_recompute` is that
repair alone, on a KV the caller composed (no I/O). What "matter most" means is the
``selection``: ``"deviation"`` (CacheBlend's: the tokens whose values deviate most from a
prefill of the composed prompt at an early layer) or ``"query"`` (the tokens the prompt's
uncached tail, typically the question, attends to most at a middle layer). The first-k
repair is :func:`lmcache_async.hf.compose_and_repair`;
which of these edits are exact and which approximate, with the measured quality:
``docs/guides/kv-editing.md``.

Every argument is checked before anything is sent; a miss stores nothing; what is stored
is the KV the model reads. Model computation runs on :func:`lmcache_async.hf.run_model`'s
worker thread: no deadline of its own, and a cancelled call cannot stop a forward pass
already running (its result is discarded, nothing is stored).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from lmcache_async._base.timeouts import DEFAULT, DefaultType
from lmcache_async._engine import compose as _compose, hf_recompute as _hf_recompute
from lmcache_async._engine.compose import KVPart
from lmcache_async._protocol.wire import validate_cache_salt
from lmcache_async.hf import (
    ComposedPrompt,
    _cache_layers,
    _check_new_tokens,
    _compose_repair_store,
    _forward,
    _model_device,
    _prompt,
    _recompute_at,
    _Serve,
    _text_config,
    check_geometry,
    geometry_from_model,
    kv_to_cache,
    prefill_and_store,
)
from lmcache_async.rope import RopeSpec

if TYPE_CHECKING:
    from lmcache_async.client import AsyncClient

__all__ = [
    "SELECTIONS",
    "cache_document",
    "compose_and_blend",
    "default_select_layer",
    "select_and_recompute",
]

#: The selection rules of the selective repair: ``"deviation"`` (CacheBlend's) and
#: ``"query"`` (the tail's attention).
SELECTIONS = ("deviation", "query")


def _check_selection(selection: object) -> str:
    if not isinstance(selection, str) or selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {', '.join(map(repr, SELECTIONS))}, got {selection!r}")
    return selection


def default_select_layer(selection: str, num_layers: int) -> int:
    """The layer a ``selection`` reads by default: 1 for ``"deviation"`` (layer 0's
    values depend only on the token, so they cannot tell), about a quarter of the depth
    for ``"query"`` (layer 7 of SmolLM2's 30; measured in the KV-editing guide)."""
    if _check_selection(selection) == "deviation":
        return min(1, num_layers - 1)
    return min(max(1, num_layers // 4), num_layers - 1)


def _select_layer(selection: str, select_layer: object, n_layers: int) -> int:
    """``select_layer``, checked, or the selection's default where it is ``None``."""
    if select_layer is None:
        return default_select_layer(selection, n_layers)
    if (
        isinstance(select_layer, bool)
        or not isinstance(select_layer, int)
        or not 0 <= select_layer < n_layers
    ):
        raise ValueError(f"select_layer must be an int in 0..{n_layers - 1}, got {select_layer!r}")
    return select_layer


def _check_fraction(recompute_fraction: float) -> float:
    if (
        isinstance(recompute_fraction, bool)
        or not isinstance(recompute_fraction, int | float)
        or not 0.0 <= recompute_fraction <= 1.0  # NaN fails this too
    ):
        raise ValueError(f"recompute_fraction must be a number in [0, 1], got {recompute_fraction!r}")
    return float(recompute_fraction)


def _decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The model's decoder layers (the ``ModuleList`` of ``num_hidden_layers`` modules)."""
    n = int(_text_config(model.config).num_hidden_layers)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
        return layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"cannot find the model's {n} decoder layers (a ModuleList of {n} modules)")


class _StopForward(Exception):
    """Raised by a forward hook to end a forward pass after an early layer."""


def _layer_kv(
    model: Any, toks: list[int], kv: torch.Tensor, start: int, end: int, layer: int
) -> torch.Tensor:
    """The KV at ``layer`` of ``toks[start:end]`` prefilled over ``kv[:, :, :start]``,
    ``[2, end - start, D]``; the layers after ``layer`` are not run."""
    geometry = geometry_from_model(model)
    cache = _run_until(model, toks, kv, start, end, _decoder_layers(model)[layer])
    key, value = _cache_layers(cache)[layer]
    h, hd = geometry.num_kv_heads, geometry.head_dim
    out = torch.empty((2, end - start, h * hd), dtype=geometry.dtype, device=key.device)
    out[0].view(end - start, h, hd).copy_(key[0, :, start:end].transpose(0, 1))
    out[1].view(end - start, h, hd).copy_(value[0, :, start:end].transpose(0, 1))
    return out


def _layer_values(
    model: Any, toks: list[int], kv: torch.Tensor, start: int, end: int, layer: int
) -> torch.Tensor:
    """The values at ``layer`` of ``toks[start:end]`` prefilled over ``kv[:, :, :start]``,
    ``[end - start, D]``: the pass stops at that layer's value projection (its attention,
    MLP and the layers after it are not run; a layer without a ``self_attn.v_proj``
    module runs whole)."""
    v_proj = getattr(getattr(_decoder_layers(model)[layer], "self_attn", None), "v_proj", None)
    if not isinstance(v_proj, torch.nn.Module):
        return _layer_kv(model, toks, kv, start, end, layer)[1]
    captured: list[torch.Tensor] = []
    if _hf_recompute.usable(model, kv):  # on a GPU: over a copy of the layers that run
        geometry = geometry_from_model(model)
        scratch = kv[:, :layer, :end].clone()
        heads, head_dim = geometry.num_kv_heads, geometry.head_dim
        ids, positions = toks[start:end], range(start, end)
        _hf_recompute.run(model, scratch, ids, positions, heads, head_dim, v_proj, captured)
    else:
        _run_until(model, toks, kv, start, end, v_proj, captured)
    if not captured:  # pragma: no cover - a model that never calls v_proj
        return _layer_kv(model, toks, kv, start, end, layer)[1]
    return captured[0].reshape(end - start, -1)


def _run_until(
    model: Any,
    toks: list[int],
    kv: torch.Tensor,
    start: int,
    end: int,
    module: torch.nn.Module,
    captured: list[torch.Tensor] | None = None,
) -> Any:
    """Prefill ``toks[start:end]`` over ``kv[:, :, :start]`` until ``module`` has run (its
    output appended to ``captured``), nothing after it; returns the cache."""
    if start:
        cache = kv_to_cache(
            kv[:, :, :start], geometry_from_model(model), config=model.config, device=_model_device(model)
        )
    else:
        cache = DynamicCache(config=model.config)

    def stop(_module: Any, _args: Any, out: Any) -> None:
        if captured is not None:
            captured.append(out)
        raise _StopForward

    handle = module.register_forward_hook(stop)
    try:
        _forward(model, toks[start:end], cache, start)
    except _StopForward:
        pass
    finally:
        handle.remove()
    return cache


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _query_attention(model: Any, toks: list[int], kv: torch.Tensor, exact: int, layer: int) -> torch.Tensor:
    """The attention the tail ``toks[T:]`` (``T = kv.shape[2]``) pays at ``layer`` to each
    of the tokens ``exact .. T - 1``, summed over its tokens and the query heads, ``[T -
    exact]`` (float32): the tail is prefilled over ``kv`` through ``layer``'s attention
    only (the layers after it do not run); its queries are the layer's own (projection,
    the ``q_norm`` a model has, rotary embedding as transformers' Llama applies it) and its
    weights are a softmax over every key it sees (the composed KV and its own, causal),
    as the model's attention computes them."""
    attn = getattr(_decoder_layers(model)[layer], "self_attn", None)
    q_proj = getattr(attn, "q_proj", None)
    if attn is None or not isinstance(q_proj, torch.nn.Module):
        raise ValueError("selection='query' needs Llama-style attention (a self_attn with a q_proj)")
    total = kv.shape[2]
    seen: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = []

    def before(_module: Any, args: Any, kwargs: Any) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        rotary = kwargs.get("position_embeddings")
        if isinstance(hidden, torch.Tensor) and isinstance(rotary, tuple) and len(rotary) == 2:
            seen.append((hidden, rotary))

    def after(*_: Any) -> None:
        raise _StopForward

    cache = kv_to_cache(kv, geometry_from_model(model), config=model.config, device=_model_device(model))
    handles = [attn.register_forward_pre_hook(before, with_kwargs=True), attn.register_forward_hook(after)]
    try:
        _forward(model, toks[total:], cache, total)
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    if not seen:
        raise ValueError(
            "selection='query' needs Llama-style attention: its self_attn called with "
            "hidden_states and position_embeddings=(cos, sin)"
        )
    hidden, (cos, sin) = seen[0]
    head_dim = int(getattr(attn, "head_dim", kv.shape[3] // geometry_from_model(model).num_kv_heads))
    n = hidden.shape[1]
    with torch.no_grad():
        q = q_proj(hidden).view(1, n, -1, head_dim)
        q_norm = getattr(attn, "q_norm", None)
        if isinstance(q_norm, torch.nn.Module):
            q = q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = (q * cos + _rotate_half(q) * sin)[0].float()  # [H, n, hd]
    keys = _cache_layers(cache)[layer][0][0].float()  # [KVH, T + n, hd]: composed and the tail's
    keys = keys.repeat_interleave(q.shape[0] // keys.shape[0], dim=0)
    scores = (q @ keys.transpose(1, 2)) * float(getattr(attn, "scaling", head_dim**-0.5))
    future = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
    scores[:, :, total:].masked_fill_(future, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return weights[:, :, exact:total].sum(dim=(0, 1)).cpu()


def _exact_prefix(the_plan: _compose.Plan) -> int:
    """Target tokens at the start whose composed KV is the full prefill's: a first part
    that is its source's own prefix, at its own positions, with the target's tokens."""
    first = the_plan.placements[0]
    part = first.part
    if first.offset or part.start or not first.placed:
        return 0
    if tuple(part.source_tokens[: first.placed]) != the_plan.target[: first.placed]:
        return 0
    return first.placed


def select_and_recompute(
    model: Any, tokens: Sequence[int], kv: torch.Tensor, spans: Sequence[tuple[int, int]],
    recompute_fraction: float, *, select_layer: int | None = None, exact: int = 0,
    selection: str = "deviation",
) -> list[int]:  # fmt: skip
    """The selective repair on a composed KV, in place (no I/O).

    ``kv`` (``[2, L, T, D]``) holds the KV of ``tokens[:T]`` as composed from cached
    parts; ``kv[:, :, :exact]`` is already the full prefill's. In each span ``[a, b)`` (a
    part's tokens) the ``round(recompute_fraction * (b - a))`` tokens that score highest
    are chosen, the score being the ``selection``'s at layer ``select_layer`` (default:
    :func:`default_select_layer`):

    * ``"deviation"`` (CacheBlend's): the tokens after ``exact`` are prefilled up to the
      value projection of ``select_layer`` only; a token's score is the squared distance
      between its composed values there and that prefill's.
    * ``"query"``: the tail ``tokens[T:]`` (the question; it must not be empty) is
      prefilled over the composed KV through ``select_layer``'s attention only; a token's
      score is the attention weight the tail pays it there (summed over the tail's tokens
      and the heads).

    The chosen tokens are then recomputed through every layer in one
    pass, each attending to the composed KV of the tokens before it that were not chosen
    and to the recomputed KV of those that were, and their KV replaces the composed one.

    ``recompute_fraction=0`` leaves ``kv`` untouched (no model work); 1 recomputes every
    token of the spans, which is a prefill of them over ``kv`` in front (the full
    prefill's KV when the spans cover ``exact .. T``, to float rounding).

    Returns:
        The recomputed positions, ascending.

    Raises:
        ValueError: a fraction outside [0, 1], an unknown ``selection``, ``select_layer``
            outside the model's layers, spans outside ``exact .. T`` or overlapping, a
            ``kv`` of another shape, or ``"query"`` with no tokens after ``T``.
    """
    fraction = _check_fraction(recompute_fraction)
    selection = _check_selection(selection)
    geometry = geometry_from_model(model)
    n_layers = geometry.num_layers
    layer = _select_layer(selection, select_layer, n_layers)
    toks = list(tokens)
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != n_layers or kv.shape[2] > len(toks):
        raise ValueError(f"kv has shape {list(kv.shape)}; expected [2, {n_layers}, T <= {len(toks)}, D]")
    total = kv.shape[2]
    last = exact
    for a, b in sorted(spans):
        if not exact <= a <= b <= total or a < last:
            raise ValueError(f"span [{a}, {b}) is outside {exact}..{total} or overlaps another")
        last = b
    if selection == "query" and len(toks) <= total:
        raise ValueError(
            f"selection='query' needs tokens after the composed KV's {total} (the question); "
            f"there are {len(toks) - total}"
        )
    counts = [(a, b, min(b - a, int(fraction * (b - a) + 0.5))) for a, b in spans]
    if not any(c for _, _, c in counts):
        return []
    if selection == "query":
        score = _query_attention(model, toks, kv, exact, layer)
    else:
        early = _layer_values(model, toks, kv, exact, total, layer).float()
        composed = kv[1, layer, exact:total].to(early.device).float()
        score = (early - composed).pow(2).sum(dim=1)  # [T - exact]
    chosen: list[int] = []
    for a, b, c in counts:
        if c:
            top = torch.topk(score[a - exact : b - exact], c).indices
            chosen.extend(i + a for i in top.tolist())
    chosen.sort()
    _recompute_at(model, toks, kv, chosen)
    return chosen


async def compose_and_blend(
    client: AsyncClient,
    model: Any,
    target_tokens: Sequence[int],
    parts: Sequence[KVPart],
    *,
    recompute_fraction: float,
    selection: str = "deviation",
    select_layer: int | None = None,
    rope: RopeSpec | None = None,
    cache_salt: str = "",
    max_new_tokens: int = 0,
    eos_token_id: int | None = None,
    timeout: float | DefaultType | None = DEFAULT,
) -> ComposedPrompt:
    """Compose cached documents into ``target_tokens``, recompute the share of each
    part's tokens whose KV matters most, and store the target (the selective repair, as
    CacheBlend's).

    The parts' KV is taken from the cache and placed as :meth:`AsyncClient.compose
    <lmcache_async.AsyncClient.compose>` does (shifted keys rotated with ``rope``). A
    leading part that is its source's own prefix at its own positions is already the
    full prefill's KV and is kept. In each of the other parts, the
    ``round(recompute_fraction * tokens)`` tokens that score highest by ``selection`` at
    layer ``select_layer`` are recomputed through every layer over the composed KV
    (:func:`select_and_recompute`): ``"deviation"``, CacheBlend's, the tokens whose
    composed values deviate most from a prefill of the composed prompt stopped at that
    layer; ``"query"``, the tokens the target's tail after the stored chunks (the
    question) attends to most there. Then the target's whole chunks are stored, so the
    stored KV is what the model reads when it serves the target.

    ``recompute_fraction=0`` is plain composition (bitwise; the model does not run); 1
    recomputes every part token (the full prefill's KV to float rounding).

    Args:
        client: an open client with the model's geometry.
        model: the transformers causal LM whose KV the cache holds (Llama-style: its
            decoder layers a ``ModuleList``).
        target_tokens: the prompt to store (the parts fill its beginning; with
            ``"query"``, the question follows them).
        parts: :class:`~lmcache_async.KVPart` ranges, in order.
        recompute_fraction: the share of each part's tokens recomputed, in [0, 1] (the
            quality/latency knob, CacheBlend's default 0.15; the KV-editing guide's table
            measures what each fraction keeps on a trained model).
        selection: ``"deviation"`` (default) or ``"query"`` (see above). The guide's table
            compares them: on SmolLM2-135M with documents cached alone, ``"query"``
            answers as often right as ``"deviation"`` on held-out sets, from a cheaper pass;
            on documents cached behind the system prompt it is worse. The tokens it
            chooses depend on the question.
        select_layer: the layer the selection reads (default
            :func:`default_select_layer`: 1 for ``"deviation"``, a quarter of the depth
            for ``"query"``).
        rope: the model's rotary embedding (default: ``RopeSpec.from_hf_config(model.config)``).
        cache_salt: the target's namespace and the parts' default.
        max_new_tokens: with ``> 0``, also serve the target from the composed KV while
            its store runs (as :func:`~lmcache_async.hf.compose_and_repair`:
            :attr:`ComposedPrompt.generation`, :attr:`ComposedPrompt.stored`).
        eos_token_id: stop generating after this token.
        timeout: one deadline for the retrieves and the store (default: the client's);
            the model's computation has none.

    Returns:
        A :class:`ComposedPrompt` (``recomputed_positions``: the tokens chosen). On a miss
        of any part nothing is computed or stored and ``result.missed`` names the parts.

    Raises:
        ValueError/TypeError: a fraction outside [0, 1] (or not a number), an unknown
            ``selection``, a ``select_layer`` outside the model's layers, ``"query"`` on a
            target with no tokens after the parts' whole chunks, the other arguments as
            :func:`compose_and_repair` (all before anything is sent).
        LMCacheTimeoutError: no answer within ``timeout``.

    Cancellation/timeout: during the retrieves nothing is stored; the model's work
    already running in the model thread finishes and is dropped; during the store, as
    :meth:`AsyncClient.store`; with ``max_new_tokens``, as
    :func:`~lmcache_async.hf.compose_and_repair`. Runs on the model's device (a GPU
    model: retrieves, rotation, selection and recomputation in GPU memory).
    """
    toks = _prompt(target_tokens, model)
    fraction = _check_fraction(recompute_fraction)
    selection = _check_selection(selection)
    _check_new_tokens(max_new_tokens)
    n_layers = geometry_from_model(model).num_layers
    layer = _select_layer(selection, select_layer, n_layers)
    if fraction:
        _decoder_layers(model)  # a model whose layers cannot be found is refused before sending

    def check(the_plan: _compose.Plan) -> None:
        if fraction and selection == "query" and the_plan.stored >= len(toks):
            raise ValueError(
                "selection='query' needs target tokens after the parts' whole chunks (the question); "
                f"the target's {len(toks)} tokens are all stored"
            )

    def repair(the_plan: _compose.Plan, kv: torch.Tensor, toks: list[int]) -> list[int]:
        exact = _exact_prefix(the_plan)
        spans = [
            (max(p.offset, exact), p.offset + p.placed)
            for p in the_plan.placements
            if p.placed and p.offset + p.placed > exact
        ]
        return select_and_recompute(
            model, toks, kv, spans, fraction, select_layer=layer, exact=exact, selection=selection
        )

    serve = _Serve(max_new_tokens, eos_token_id) if max_new_tokens else None
    return await _compose_repair_store(
        client, model, toks, parts, rope, cache_salt, timeout, repair if fraction else None, check, serve
    )


async def cache_document(
    client: AsyncClient,
    model: Any,
    document: Sequence[int],
    *,
    prefix: Sequence[int] = (),
    pad_token_id: int | None = None,
    cache_salt: str = "",
    timeout: float | DefaultType | None = DEFAULT,
) -> KVPart:
    """Cache a document for composition, alone or behind a fixed ``prefix``, and return
    the :class:`~lmcache_async.KVPart` of its tokens.

    The source ``prefix + document``, padded with ``pad_token_id`` to whole chunks (LMCache
    stores whole chunks only, so the document's last tokens would otherwise not be
    cached), is prefilled and stored unless the cache already holds all of it. The part
    is ``KVPart(source, len(prefix), len(prefix) + len(document), cache_salt)``; when the
    target starts with ``prefix + document``, ``KVPart(part.source_tokens, 0, part.end)``
    covers both and is the full prefill's KV (:func:`compose_and_blend` keeps it as is).
    Which protocol composes better on a trained model (a document cached alone at
    position 0, or behind the system prompt it will be served with) is measured in the
    KV-editing guide's table.

    Args:
        client: an open client with the model's geometry.
        model: the transformers causal LM.
        document: the document's token ids (not empty).
        prefix: tokens in front of the document when it is computed (e.g. the system
            prompt); default none (the document at positions 0..).
        pad_token_id: the token that pads the source to whole chunks; needed unless
            ``len(prefix) + len(document)`` is a multiple of the chunk size.
        cache_salt: the source's namespace (also the returned part's).
        timeout: for each request (the lookup, then the store); the model has none.

    Raises:
        ValueError/TypeError: empty or bad tokens, a pad token outside the vocabulary or
            missing where padding is needed, a bad salt, a client of another geometry (all
            before anything is sent).
        LMCacheTimeoutError: a request had no answer within ``timeout``.

    Cancellation/timeout: during the lookup nothing is stored; a prefill already running
    in the model thread finishes and is dropped; during the store, as
    :meth:`AsyncClient.store <lmcache_async.AsyncClient.store>`.
    """
    doc = _prompt(document, model)
    front = list(prefix)
    source = _prompt(front + doc, model)  # validates the prefix's ids too
    validate_cache_salt(cache_salt)
    check_geometry(client.geometry, geometry_from_model(model))
    pad = -len(source) % client.chunk_size
    if pad:
        if pad_token_id is None:
            raise ValueError(
                f"prefix + document is {len(source)} tokens, not whole chunks of {client.chunk_size}: "
                "pass pad_token_id"
            )
        source += _prompt([pad_token_id], model) * pad
    if await client.lookup(source, cache_salt, timeout=timeout) < len(source):
        await prefill_and_store(client, model, source, cache_salt, timeout=timeout)
    return KVPart(source, len(front), len(front) + len(doc), cache_salt=cache_salt)
