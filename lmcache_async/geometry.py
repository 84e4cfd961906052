"""KV geometry: the shape of a model's KV cache as LMCache stores it.

A :class:`KVGeometry` either comes from the server's ``/status`` (an inference engine
registered its paged KV layout, listed under ``cache_context_meta``) or is given
explicitly to :func:`lmcache_async.connect`, in which case no engine registration is
needed at all.

LMCache stores one object per chunk of ``CS`` tokens: ``[2, L, CS, D]`` (K and V) or
``[L, CS, D]`` for single-plane (MLA) layouts, ``D = num_kv_heads * head_dim`` with heads
outermost.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from lmcache_async.errors import HybridLayoutError, ModelNotRegisteredError, ProtocolError

__all__ = ["MAX_CHUNK_BYTES", "KVGeometry", "check_server_geometry", "dtype_from_name", "dtype_name"]

_DTYPES: Final[dict[str, torch.dtype]] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}

# engine_kv_format name -> (axis of block size, axis of heads, single plane) inside the
# per-layer tensor; None where the format has no such axis. Only per-layer single-tensor
# formats whose objects LMCache stores as [2, L, CS, D] (or [L, CS, D] for MLA) are listed.
_FORMATS: Final[dict[str, tuple[int | None, int | None, bool]]] = {
    "NL_X_TWO_NB_BS_NH_HS": (2, 3, False),  # vLLM flash attention
    "NL_X_NB_TWO_BS_NH_HS": (2, 3, False),  # flashinfer NHD
    "NL_X_TWO_NB_NH_BS_HS": (3, 2, False),  # HND
    "NL_X_NB_TWO_NH_BS_HS": (3, 2, False),  # flashinfer HND
    "NL_X_NB_BS_HS": (1, None, True),  # MLA
    "NL_X_NBBS_ONE_HS": (None, None, True),  # MLA, fused blocks
    "NL_X_NP_X_NB_BS_ONE_HS": (1, None, True),  # MLA pools
}


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    bare = name.removeprefix("torch.")
    try:
        return _DTYPES[bare]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; known: {', '.join(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the server's ``dtype_str``)."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


#: The most bytes one chunk of a geometry read from a server's ``/status`` may take
#: (64 GiB; a 70B model's 256-token chunk in bfloat16 is 80 MiB): a larger one is an
#: absurd or hostile document, refused at connect, never used to size a tensor.
MAX_CHUNK_BYTES: Final = 1 << 36


def check_server_geometry(geometry: KVGeometry, chunk_size: int) -> None:
    """Refuse a geometry from ``/status`` whose one chunk would exceed
    :data:`MAX_CHUNK_BYTES` (e.g. ``num_layers=10**9``).

    Raises:
        ProtocolError: naming the geometry and the chunk's bytes.
    """
    nbytes = geometry.bytes_per_token * chunk_size
    if nbytes > MAX_CHUNK_BYTES:
        raise ProtocolError(
            f"/status describes an absurd KV geometry ({geometry}): one chunk of {chunk_size} tokens "
            f"would be {nbytes} bytes, more than {MAX_CHUNK_BYTES} (64 GiB); pass geometry= explicitly"
        )


#: Groups a :class:`~lmcache_async.errors.HybridLayoutError` describes (the rest are counted).
_MAX_GROUPS_SHOWN: Final = 8


def _text(value: object, limit: int = 60) -> str:
    """``value`` as text of at most ``limit`` characters (it comes from the server)."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _layers(value: object) -> str:
    """Layer indices as ranges: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        return _text(value)
    runs: list[str] = []
    for i in value:
        if runs and runs[-1].split("-")[-1] == str(i - 1):
            runs[-1] = f"{runs[-1].split('-')[0]}-{i}"
        else:
            runs.append(str(i))
    return _text(", ".join(runs))


def _describe_groups(groups: list[Any]) -> list[str]:
    """One line per kernel group of a ``/status`` layout (hostile values truncated)."""
    out = []
    for i, group in enumerate(groups[:_MAX_GROUPS_SHOWN]):
        g = group if isinstance(group, Mapping) else {}
        out.append(
            f"group {i}: layers {_layers(g.get('layer_indices'))} "
            f"({_text(g.get('engine_kv_format'))}, {_text(g.get('engine_kv_concrete_shape'))}, "
            f"{_text(g.get('tokens_per_block'))} tokens per block)"
        )
    if len(groups) > _MAX_GROUPS_SHOWN:
        out.append(f"and {len(groups) - _MAX_GROUPS_SHOWN} more")
    return out


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The KV layout of one model as LMCache stores it.

    Attributes:
        num_layers: transformer layers ``L``.
        num_kv_heads: KV heads per worker (1 for MLA).
        head_dim: head size.
        dtype: element type.
        block_size: the engine's tokens per paged block (the chunk size must be a multiple).
        use_mla: single-plane ``[L, T, D]`` objects instead of ``[2, L, T, D]``.
        world_size: KV world size of the registration (1 for a single GPU).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    use_mla: bool = False
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"KVGeometry.{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"KVGeometry.{name} must be >= 1, got {value}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"KVGeometry.dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        dtype_name(self.dtype)
        if self.use_mla and self.num_kv_heads != 1:
            raise ValueError("an MLA geometry has num_kv_heads == 1")

    @property
    def hidden_dim(self) -> int:
        """``D = num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def planes(self) -> int:
        """2 (K and V) or 1 (single plane)."""
        return 1 if self.use_mla else 2

    @property
    def bytes_per_token(self) -> int:
        return self.planes * self.num_layers * self.hidden_dim * self.dtype.itemsize

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of the KV of ``num_tokens`` tokens: ``[2, L, T, D]`` or ``[L, T, D]``."""
        if self.use_mla:
            return (self.num_layers, num_tokens, self.hidden_dim)
        return (2, self.num_layers, num_tokens, self.hidden_dim)

    @property
    def token_axis(self) -> int:
        return 1 if self.use_mla else 2

    @classmethod
    def from_status(cls, status: Mapping[str, Any], model_name: str) -> KVGeometry:
        """Derive the geometry of ``model_name`` from a ``/status`` document.

        Raises:
            ModelNotRegisteredError: no ``cache_context_meta`` entry names the model.
            HybridLayoutError: the model's entry has several KV (kernel) groups.
            ProtocolError: the entry cannot be decoded (e.g. a layout format this client
                does not support).
        """
        meta = status.get("cache_context_meta") or {}
        if not isinstance(meta, Mapping):
            raise ProtocolError("/status cache_context_meta is not an object")
        entries = [e for e in meta.values() if isinstance(e, Mapping)]
        for entry in entries:
            if entry.get("model_name") == model_name:
                return cls.from_context_meta(entry)
        names = sorted({str(e.get("model_name")) for e in entries})
        raise ModelNotRegisteredError(model_name, names)

    @classmethod
    def from_context_meta(cls, entry: Mapping[str, Any]) -> KVGeometry:
        """Decode one ``cache_context_meta`` entry (see the module docstring).

        Raises:
            HybridLayoutError: the entry has several KV (kernel) groups.
            ProtocolError: the entry cannot be decoded.
        """
        try:
            layout = entry["kv_cache_layout"]
            groups = layout["kernel_groups"]
            if not isinstance(groups, list) or not groups:
                raise ProtocolError(f"kernel_groups is not a non-empty list: {str(groups)[:80]!r}")
            if len(groups) != 1:
                raise HybridLayoutError(_text(entry.get("model_name"), 200), _describe_groups(groups))
            group = groups[0]
            fmt = str(group["engine_kv_format"])
            if fmt not in _FORMATS:
                raise ProtocolError(f"engine_kv_format {fmt} is not supported; pass geometry= explicitly")
            bs_axis, nh_axis, single = _FORMATS[fmt]
            shape = str(group["engine_kv_concrete_shape"])
            m = re.search(r"\[([0-9,\s]+)\]", shape)
            if m is None:
                raise ProtocolError(f"cannot parse engine_kv_concrete_shape {shape!r}")
            inner = [int(x) for x in m.group(1).split(",")]
            tokens_per_block = int(group.get("tokens_per_block", 0))
            block_size = inner[bs_axis] if bs_axis is not None else tokens_per_block
            if tokens_per_block and block_size != tokens_per_block:
                raise ProtocolError(f"decoded block size {block_size} != tokens_per_block {tokens_per_block}")
            heads = 1 if (single or nh_axis is None) else inner[nh_axis]
            single = single or bool(group.get("is_mla", False))
            return cls(
                num_layers=int(layout.get("num_layers") or group["num_layers"]),
                num_kv_heads=heads,
                head_dim=inner[-1],
                dtype=dtype_from_name(str(group["dtype"])),
                block_size=block_size,
                use_mla=single,
                world_size=int(entry.get("world_size", 1)),
            )
        except (ProtocolError, HybridLayoutError):
            raise
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ProtocolError(f"cannot decode cache_context_meta entry: {exc!r}") from exc
