"""What an :class:`~lmcache_async.testing.EmbeddedServer` is started with: the models it
declares (:class:`ModelSpec`, as if an inference engine had registered them) and sizes
written the way the real server's options are (:func:`parse_size`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Final

from lmcache_async.geometry import KVGeometry, dtype_from_name
from lmcache_async.testing.vocabulary import LayoutSpec

__all__ = ["ModelSpec", "parse_size"]

#: The engine KV format a declared model shows in ``/status`` (vLLM flash attention).
_KV_FORMAT: Final = "NL_X_TWO_NB_BS_NH_HS"


def parse_size(text: str | int) -> int:
    """``"2GB"``, ``"512MiB"``, ``"64k"``, ``"1073741824"`` -> bytes (binary units).

    K/KB/KiB = 1024, M/MB/MiB = 2**20, G/GB/GiB = 2**30, T/TB/TiB = 2**40 (as the real
    server's ``--l1-size-gb``, which counts GiB). Raises ``ValueError`` otherwise.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().lower().replace(" ", "")
        units = {"t": 2**40, "g": 2**30, "m": 2**20, "k": 2**10, "b": 1, "": 1}
        number = s.rstrip("bi") if s.endswith(("ib", "b")) else s
        unit = number[-1:] if number[-1:].isalpha() else ""
        digits = number[: len(number) - len(unit)]
        if unit not in units or not digits:
            raise ValueError(f"cannot parse size {text!r} (e.g. 1073741824, 512MB, 2GB)")
        try:
            value = int(float(digits) * units[unit])
        except ValueError:
            raise ValueError(f"cannot parse size {text!r} (e.g. 1073741824, 512MB, 2GB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model declared at start, as if an inference engine (vLLM) had registered it.

    It appears in ``/status`` ``cache_context_meta`` in the real server's format (vLLM
    flash-attention layout ``NL_X_TWO_NB_BS_NH_HS``), so :meth:`KVGeometry.from_status`
    and the official SDK derive its geometry, and its object layout
    ``[2, num_layers, chunk_size, num_kv_heads * head_dim]`` is registered so lookups of
    the model work before any client registers.

    Attributes:
        name: model name (no ``@``).
        num_layers, num_kv_heads, head_dim: geometry (heads per worker).
        block_size: the engine's tokens per paged block.
        dtype: torch dtype name, e.g. ``"bfloat16"``.
        world_size: KV world size of the registration.
        num_blocks: blocks of the pretended engine cache (only shown in ``/status``).
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "bfloat16"
    world_size: int = 1
    num_blocks: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "@" in self.name:
            raise ValueError(f"invalid model name {self.name!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "world_size", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{name} must be an int >= 1, got {value!r}")
        dtype_from_name(self.dtype)

    @property
    def registration_id(self) -> int:
        """The pretended engine registration id (stable for a name and world size)."""
        digest = hashlib.blake2b(f"{self.name}/{self.world_size}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") & (2**63 - 1)

    def geometry(self) -> KVGeometry:
        return KVGeometry(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype_from_name(self.dtype),
            block_size=self.block_size,
            world_size=self.world_size,
        )

    def layout(self, chunk_size: int) -> LayoutSpec:
        return LayoutSpec(
            (2, self.num_layers, chunk_size, self.num_kv_heads * self.head_dim), dtype_from_name(self.dtype)
        )

    def context_meta(self) -> dict[str, Any]:
        """The ``cache_context_meta`` entry the real server shows for such a vLLM worker."""
        dtype = dtype_from_name(self.dtype)
        hidden = self.num_kv_heads * self.head_dim
        shape = f"[2, {self.num_blocks}, {self.block_size}, {self.num_kv_heads}, {self.head_dim}]"
        return {
            "model_name": self.name,
            "world_size": self.world_size,
            "kv_cache_layout": {
                "num_layers": self.num_layers,
                "num_blocks": self.num_blocks,
                "cache_size_per_token": 2 * self.num_layers * hidden * dtype.itemsize,
                "kernel_groups": [
                    {
                        "kernel_group_idx": 0,
                        "engine_group_idx": 0,
                        "object_group_idx": 0,
                        "num_layers": self.num_layers,
                        "layer_indices": list(range(self.num_layers)),
                        "tokens_per_block": self.block_size,
                        "slots_per_block": self.block_size,
                        "dtype": str(dtype),
                        "engine_kv_concrete_shape": f"{self.num_layers} x {shape}",
                        "is_mla": False,
                        "engine_kv_format": _KV_FORMAT,
                        "engine_kv_shape": "NL x [2, NB, BS, NH, HS]",
                        "attention_backend": "vLLM non-MLA flash attention",
                    }
                ],
            },
        }
