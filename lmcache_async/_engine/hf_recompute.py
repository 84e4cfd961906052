"""The repairs' forward passes on a GPU: each layer's new KV written into the composed KV
in place, attention cut at each token's position (:func:`attend_up_to`)
(docs/guides/kv-editing.md, "The repairs' passes on a GPU").

Used by :mod:`lmcache_async.hf` where :func:`usable` says so (a model on a GPU whose
attention is transformers' ``"sdpa"``). The attention is plugged in for the pass only and
serves only the thread running the pass; every other call goes to ``"sdpa"``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

__all__ = [
    "BLOCK_QUERIES",
    "BLOCK_SPAN",
    "DEVICES",
    "attend_up_to",
    "blocks",
    "forward_params",
    "run",
    "usable",
]

#: The most queries one block holds, and the longest range of positions it spans.
BLOCK_QUERIES: Final = 256
BLOCK_SPAN: Final = 2048
#: The device types the in-place pass runs on (tests add ``"cpu"``).
DEVICES: tuple[str, ...] = ("cuda",)
#: The name the attention function is registered under with transformers.
NAME: Final = "lmcache_async_in_place"

_local = threading.local()
_lock = threading.Lock()
#: id(config): [config, its own attention implementation, passes running]
_switched: dict[int, list[Any]] = {}
_registered = False
_warned = False
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Pass:
    kv: torch.Tensor  # [2, L, T, D]: layer i's new KV is written at ``at`` in kv[:, i]
    at: torch.Tensor  # [n] positions, ascending, on kv's device
    blocks: tuple[tuple[int, int, int, int], ...]
    heads: int
    head_dim: int


def blocks(positions: Sequence[int]) -> tuple[tuple[int, int, int, int], ...]:
    """``positions`` (ascending) cut into blocks ``(start, end, first, last)``: at most
    :data:`BLOCK_QUERIES` queries, ``last - first < BLOCK_SPAN``."""
    out: list[tuple[int, int, int, int]] = []
    s, n = 0, len(positions)
    while s < n:
        e = s + 1
        while e < n and e - s < BLOCK_QUERIES and positions[e] - positions[s] < BLOCK_SPAN:
            e += 1
        out.append((s, e, positions[s], positions[e - 1]))
        s = e
    return tuple(out)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q kᵀ scale) v`` and its log-sum-exp (float32, ``[1, H, Lq]``), no mask;
    ``q``, ``k``, ``v`` with the same heads. A fused kernel on CUDA, else in float32."""
    global _warned
    n = q.shape[2]
    if q.is_cuda:
        aten = torch.ops.aten
        try:
            if q.dtype in (torch.float16, torch.bfloat16):
                out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
            else:
                out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)
            return out[0], out[1][..., :n].float()  # the efficient kernel pads the LSE's rows
        except RuntimeError as exc:  # a kernel that does not take these inputs
            if not _warned:
                _warned = True
                log.warning("lmcache-async: the repair's attention without a fused kernel (%s)", exc)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()), lse


def attend_up_to(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    at: torch.Tensor,
    cut: Sequence[tuple[int, int, int, int]],
    scale: float,
) -> torch.Tensor:
    """Attention where query ``i`` sees the keys at positions ``0 .. at[i]``.

    Args:
        query: ``[1, Hq, n, hd]``; ``keys``/``values``: ``[1, Hkv, T, hd]`` (``Hq`` a
            multiple of ``Hkv``; views are fine).
        at: ``[n]`` ascending positions below ``T``; ``cut``: :func:`blocks` of them.
        scale: the softmax scale.

    Returns:
        ``[1, Hq, n, hd]`` in the query's dtype.
    """
    _, hq, n, hd = query.shape
    hkv = keys.shape[1]
    g = hq // hkv
    grouped = query.view(1, hkv, g, n, hd)  # query head h reads KV head h // g
    out = torch.empty_like(query)
    out_grouped = out.view(1, hkv, g, n, hd)
    for s, e, first, last in cut:
        m = e - s
        q = grouped[:, :, :, s:e].reshape(1, hkv, g * m, hd)  # the group's heads as more queries
        span = torch.arange(first, last + 1, device=at.device)
        seen = (span.unsqueeze(0) <= at[s:e].unsqueeze(1)).repeat(g, 1)  # row gi * m + i: query i
        scores = torch.matmul(q.float(), keys[:, :, first : last + 1].float().transpose(-1, -2)) * scale
        scores.masked_fill_(~seen, float("-inf"))
        lse_in = torch.logsumexp(scores, dim=-1)  # finite: a query sees its own position
        inside = torch.matmul(torch.softmax(scores, dim=-1), values[:, :, first : last + 1].float())
        if first:
            before, lse_before = _attend(q, keys[:, :, :first], values[:, :, :first], scale)
            lse = torch.logaddexp(lse_before, lse_in)
            inside = inside * torch.exp(lse_in - lse).unsqueeze(-1)
            inside += before.float() * torch.exp(lse_before - lse).unsqueeze(-1)
        out_grouped[:, :, :, s:e] = inside.view(1, hkv, g, m, hd).to(out.dtype)
    return out


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: the pass of this thread, or ``"sdpa"``."""
    p: _Pass | None = getattr(_local, "pass_", None)
    if p is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        sdpa: Callable[..., tuple[torch.Tensor, Any]] = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer, n, total = int(module.layer_idx), query.shape[2], p.kv.shape[2]
    for plane, new in ((0, key), (1, value)):
        p.kv[plane, layer].index_copy_(0, p.at, new[0].transpose(0, 1).reshape(n, -1).to(p.kv.dtype))
    k, v = (p.kv[i, layer].view(total, p.heads, p.head_dim).transpose(0, 1).unsqueeze(0) for i in (0, 1))
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return attend_up_to(query, k, v, p.at, p.blocks, scale).transpose(1, 2).contiguous(), None


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks of the calls handed to sdpa
    _registered = True


def _attention_config(model: Any) -> Any:
    layer = getattr(getattr(model, "model", None), "layers", [None])[0]
    return getattr(getattr(layer, "self_attn", None), "config", None)


def usable(model: Any, kv: torch.Tensor) -> bool:
    """Whether the in-place pass serves this model: ``kv`` on a device of
    :data:`DEVICES`, Llama-style decoder layers (``model.model.layers[i].self_attn``
    with its ``layer_idx``) and transformers' ``"sdpa"`` attention."""
    if kv.device.type not in DEVICES:
        return False
    try:
        _register()
    except ImportError:  # a transformers without attention and mask interfaces
        return False
    config = _attention_config(model)
    if config is None or getattr(model.model.layers[0].self_attn, "layer_idx", None) is None:
        return False
    with _lock:
        entry = _switched.get(id(config))
        own = entry[1] if entry is not None else getattr(config, "_attn_implementation", None)
    return own == "sdpa"


@contextlib.contextmanager
def _plugged(model: Any, p: _Pass) -> Iterator[None]:
    _register()
    config = _attention_config(model)
    with _lock:
        entry = _switched.get(id(config))
        if entry is None:
            entry = _switched[id(config)] = [config, config._attn_implementation, 0]
            config._attn_implementation = NAME
        entry[2] += 1
    _local.pass_ = p
    try:
        yield
    finally:
        _local.pass_ = None
        with _lock:
            entry[2] -= 1
            if not entry[2]:
                config._attn_implementation = entry[1]
                del _switched[id(config)]


def run(
    model: Any,
    kv: torch.Tensor,
    tokens: Sequence[int],
    positions: Sequence[int],
    heads: int,
    head_dim: int,
    stop: torch.nn.Module | None = None,
    captured: list[torch.Tensor] | None = None,
) -> None:
    """Run ``tokens`` at ``positions`` (ascending, below ``kv.shape[2]``) through the
    model, each layer's new KV written into ``kv`` (``[2, L', T, D]``, on the model's
    device; ``L'`` covers the layers that run) at those positions before its attention.

    With ``stop``, the pass ends once that module has run (its output appended to
    ``captured``). On an error ``kv`` holds the layers written so far."""
    device = kv.device
    at = torch.tensor(list(positions), dtype=torch.long, device=device)
    p = _Pass(kv, at, blocks(positions), heads, head_dim)
    kwargs: dict[str, Any] = {
        "input_ids": torch.tensor([list(tokens)], dtype=torch.long, device=device),
        "position_ids": at.unsqueeze(0),
        "use_cache": False,
        # 4D: transformers takes it as given (no mask is built); this attention ignores it
        "attention_mask": torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
    }
    if "logits_to_keep" in forward_params(type(model)):
        kwargs["logits_to_keep"] = 1  # the pass is for its KV: no logits over the vocabulary

    class _Stop(Exception):
        pass

    def stopped(_module: Any, _args: Any, out: Any) -> None:
        if captured is not None:
            captured.append(out)
        raise _Stop

    handle = stop.register_forward_hook(stopped) if stop is not None else None
    try:
        with _plugged(model, p), torch.no_grad():
            model(**kwargs)
    except _Stop:
        pass
    finally:
        if handle is not None:
            handle.remove()


_PARAMS: dict[Any, frozenset[str]] = {}


def forward_params(cls: Any) -> frozenset[str]:
    """The parameter names of ``cls.forward`` (looked up once per model class)."""
    params = _PARAMS.get(cls)
    if params is None:
        params = _PARAMS[cls] = frozenset(inspect.signature(cls.forward).parameters)
    return params
