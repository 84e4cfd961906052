"""Rotary position embeddings as data: move cached keys to other positions.

An inference engine caches keys *after* the rotary position embedding (RoPE) is applied
(vLLM does, and so does transformers), so the KV of a text computed at positions
``p .. p + n - 1`` serves only those positions. RoPE rotates each pair of a head's
coordinates by an angle proportional to the position, ``angle_i = position * inv_freq_i``;
rotations compose, so rotating a cached key by ``delta * inv_freq_i`` gives exactly the
key the model computes at ``position + delta``. :meth:`RopeSpec.shift` does that on
LMCache's ``[2, L, T, D]`` layout (``D = kv_heads * head_dim``, heads outermost; the
values, plane 1, are copied untouched).

Supported: the plain rotation (``default``), ``linear`` scaling, ``llama3`` and ``yarn``
(its attention factor multiplies every position's key alike, so a shift stays a pure
rotation), NeoX pairing (``i`` with ``i + rotary_dim / 2``, Llama, Mistral, Qwen) or GPT-J
pairing (``2i`` with ``2i + 1``), partial rotary dimensions, per-layer theta and scaling
and layers without RoPE. Refused with :class:`ValueError`: kinds whose angle is not
``position * constant`` (``dynamic`` NTK depends on the sequence length, ``longrope``
switches frequencies with it, multimodal ``mrope`` has several position axes) and
models without a rotary embedding (absolute positions, ALiBi): no rotation of cached
keys can move those.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

__all__ = ["RopeLayer", "RopeScaling", "RopeSpec"]

#: rope_type values whose angle is not linear in the position, and why.
_REFUSED: Final[dict[str, str]] = {
    "dynamic": "dynamic NTK scaling changes the frequencies with the sequence length",
    "longrope": "LongRoPE switches its frequencies with the sequence length",
    "su": "LongRoPE (su) switches its frequencies with the sequence length",
    "mrope": "M-RoPE (multimodal) rotates by several position axes",
    "proportional": "proportional RoPE is not supported yet",
}
#: Elements of the key plane rotated at once on the CPU (see RopeSpec.rotate_keys).
_BLOCK: Final = 1 << 16
#: Model types that pair coordinates 2i and 2i + 1 (GPT-J style).
_INTERLEAVED_MODELS: Final = frozenset({"gptj", "cohere", "cohere2", "codegen"})


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A frequency scaling of RoPE (transformers' ``rope_type`` and its parameters).

    Attributes:
        kind: ``"linear"`` (every frequency divided by ``factor``), ``"llama3"`` (low
            frequencies divided by ``factor``, high ones kept, a smooth ramp between) or
            ``"yarn"`` (NTK-by-parts interpolation between ``beta_fast`` and ``beta_slow``
            rotations; its attention factor does not change a shift).
        factor: the scaling factor (> 0).
        original_max_position_embeddings: the pre-training context (llama3, yarn).
        low_freq_factor: llama3's lower ramp bound.
        high_freq_factor: llama3's upper ramp bound.
        beta_fast: yarn's ramp bound for the fast dimensions, in rotations.
        beta_slow: yarn's ramp bound for the slow dimensions, in rotations.
        truncate: yarn rounds its ramp bounds to whole dimensions (transformers' default).
    """

    kind: Literal["linear", "llama3", "yarn"]
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3", "yarn"):
            raise ValueError(f"RopeScaling.kind must be 'linear', 'llama3' or 'yarn', got {self.kind!r}")
        if not _positive(self.factor):
            raise ValueError(f"RopeScaling.factor must be a number > 0, got {self.factor!r}")
        if self.kind != "linear":
            omp = self.original_max_position_embeddings
            if isinstance(omp, bool) or not isinstance(omp, int) or omp < 1:
                raise ValueError(
                    f"{self.kind} scaling needs original_max_position_embeddings (an int >= 1), got {omp!r}"
                )
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "llama3 scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor!r} and {self.low_freq_factor!r}"
            )


@dataclass(frozen=True, slots=True)
class RopeLayer:
    """One layer's rotary embedding where layers differ (see :attr:`RopeSpec.layers`)."""

    theta: float
    scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if not _positive(self.theta):
            raise ValueError(f"RopeLayer.theta must be a number > 0, got {self.theta!r}")
        if self.scaling is not None and not isinstance(self.scaling, RopeScaling):
            raise TypeError(f"RopeLayer.scaling must be a RopeScaling, got {type(self.scaling).__name__}")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """The rotary position embedding of a model, as data.

    Attributes:
        head_dim: size of one attention head's key.
        theta: the base of the frequencies (``rope_theta``).
        rotary_dim: the leading coordinates of each head that are rotated (even, at most
            ``head_dim``; ``None``: all of them). The others are never touched.
        interleaved: GPT-J pairing (``2i`` with ``2i + 1``); False: NeoX pairing (``i``
            with ``i + rotary_dim / 2``), which Llama-family models use.
        scaling: the frequency scaling, or ``None``.
        layers: per layer, where layers differ: a :class:`RopeLayer` (its own theta and
            scaling) or ``None`` for a layer without RoPE (its keys are never rotated);
            ``None`` (default): every layer uses ``theta`` and ``scaling``.

    Raises:
        ValueError/TypeError: a field out of range.
    """

    head_dim: int
    theta: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    scaling: RopeScaling | None = None
    layers: tuple[RopeLayer | None, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 2:
            raise ValueError(f"RopeSpec.head_dim must be an int >= 2, got {self.head_dim!r}")
        if not _positive(self.theta):
            raise ValueError(f"RopeSpec.theta must be a number > 0, got {self.theta!r}")
        rd = self.rotary_dim
        if rd is not None and (
            isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2 or rd > self.head_dim
        ):
            raise ValueError(
                f"RopeSpec.rotary_dim must be an even int in [2, head_dim={self.head_dim}], got {rd!r}"
            )
        if rd is None and self.head_dim % 2:
            raise ValueError(f"RopeSpec.head_dim {self.head_dim} is odd: give an even rotary_dim")
        if self.scaling is not None and not isinstance(self.scaling, RopeScaling):
            raise TypeError(f"RopeSpec.scaling must be a RopeScaling, got {type(self.scaling).__name__}")
        if self.layers is not None:
            layers = tuple(self.layers)
            if not layers:
                raise ValueError("RopeSpec.layers must name at least one layer (or be None)")
            for i, layer in enumerate(layers):
                if layer is not None and not isinstance(layer, RopeLayer):
                    raise TypeError(f"RopeSpec.layers[{i}] must be a RopeLayer or None, got {layer!r}")
            object.__setattr__(self, "layers", layers)

    # ------------------------------------------------------------------ frequencies

    @property
    def rotated_dims(self) -> int:
        """The coordinates of each head that RoPE rotates (``rotary_dim`` or ``head_dim``)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def layer(self, index: int) -> RopeLayer | None:
        """Layer ``index``'s theta and scaling, or ``None`` if it has no RoPE."""
        if self.layers is None:
            return RopeLayer(self.theta, self.scaling)
        return self.layers[index]

    def inv_freq(self, layer: int = 0) -> torch.Tensor:
        """The inverse frequencies of layer ``layer`` (``[rotated_dims / 2]``, float32, CPU),
        computed as transformers' rotary embeddings compute them (bitwise, on CPU).

        Raises:
            ValueError: the layer has no RoPE.
        """
        spec = self.layer(layer)
        if spec is None:
            raise ValueError(f"layer {layer} has no rotary embedding")
        return _inv_freq(spec.theta, self.rotated_dims, spec.scaling)

    # ------------------------------------------------------------------ the rotation

    def shift(self, kv: torch.Tensor, delta: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The KV ``kv`` moved by ``delta`` positions: keys rotated, values copied.

        ``kv`` is LMCache's ``[2, L, T, D]`` (``D = kv_heads * head_dim``, heads
        outermost) and holds keys computed at some positions ``p``; the result holds the
        keys at ``p + delta`` (``delta`` may be negative). The rotation runs in float32
        on ``kv``'s device (CPU or CUDA) and is rounded once to ``kv``'s dtype; plane 1
        (the values) and the coordinates past ``rotary_dim`` are copied bitwise, and so
        are the keys of layers without RoPE. ``delta == 0`` is a copy.

        Args:
            kv: the KV, a floating dtype, ``L`` equal to ``len(layers)`` if given.
            delta: positions to move by (an int, ``|delta| < 2**32``: beyond, the
                float64 angle loses precision, and no real context is that long).
            out: where to write (same shape, dtype and device as ``kv``; it may be
                ``kv`` itself); default: a new tensor.

        Returns:
            ``out`` (or the new tensor).

        Raises:
            ValueError/TypeError: a tensor that is not ``[2, L, T, D]`` with ``D`` a
                multiple of ``head_dim``, a non-floating dtype, a layer count other than
                ``len(layers)``, an ``out`` that does not match, a non-int ``delta``,
                ``|delta| >= 2**32``.

        No I/O: nothing to time out or cancel.
        """
        heads = self._check_kv(kv, "kv")
        _check_delta(delta)
        if out is None:
            out = torch.empty_like(kv, memory_format=torch.contiguous_format)
        else:
            self._check_kv(out, "out")
            if out.shape != kv.shape or out.dtype != kv.dtype or out.device != kv.device:
                raise ValueError(
                    f"out is {list(out.shape)} {out.dtype} on {out.device}, kv is "
                    f"{list(kv.shape)} {kv.dtype} on {kv.device}"
                )
        if out is not kv:
            out[1].copy_(kv[1])
        self.rotate_keys(kv[0], delta, out=out[0], heads=heads)
        return out

    def rotate_keys(
        self, keys: torch.Tensor, delta: int, *, out: torch.Tensor, heads: int | None = None
    ) -> None:
        """Write the key plane ``keys`` (``[L, T, D]``) rotated by ``delta`` positions to
        ``out`` (same shape and dtype; may be ``keys``). The building block of
        :meth:`shift`, for callers that place keys into a larger tensor.

        Raises:
            ValueError/TypeError: tensors that do not fit, a non-int ``delta``,
                ``|delta| >= 2**32``.

        No I/O: nothing to time out or cancel.
        """
        _check_delta(delta)
        for name, t in (("keys", keys), ("out", out)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{name} must be a [L, T, D] tensor, got {getattr(t, 'shape', t)!r}")
        if out.shape != keys.shape or out.dtype != keys.dtype or out.device != keys.device:
            raise ValueError(f"out is {list(out.shape)} {out.dtype}, keys {list(keys.shape)} {keys.dtype}")
        if keys.shape[-1] % self.head_dim or (self.layers is not None and keys.shape[0] != len(self.layers)):
            raise ValueError(
                f"keys of shape {list(keys.shape)} do not fit head_dim {self.head_dim}"
                + ("" if self.layers is None else f" and {len(self.layers)} layers")
            )
        if heads is None:
            heads = keys.shape[-1] // self.head_dim
        num_layers, tokens = keys.shape[0], keys.shape[1]
        hd, rd = self.head_dim, self.rotated_dims
        if delta == 0 or tokens == 0:
            if out is not keys:
                out.copy_(keys)
            return
        src = keys.view(*keys.shape[:-1], heads, hd)  # views: the last axis is split in place
        dst = out.view(*out.shape[:-1], heads, hd)
        if rd < hd and out is not keys:
            dst[..., rd:].copy_(src[..., rd:])
        # On the CPU, layer by layer in blocks of about _BLOCK elements (a few dozen
        # tokens): the float32 temporaries stay in the cache, several times faster than
        # whole planes. On CUDA, one launch per group of layers.
        cpu = keys.device.type == "cpu"
        step = max(1, _BLOCK // keys.shape[-1]) if cpu else tokens
        for layer_ids, cos, sin in self._tables(num_layers, delta, keys.device):
            if cpu:
                groups: list[list[int] | None] = [[i] for i in (layer_ids or range(num_layers))]
            else:
                groups = [layer_ids]  # None: every layer
            for ids in groups:
                for t0 in range(0, tokens, step):
                    blk = slice(t0, t0 + step)
                    if ids is None or len(ids) == 1:
                        rows = slice(None) if ids is None else slice(ids[0], ids[0] + 1)
                        _rotate_into(
                            src[rows, blk, :, :rd], cos, sin, self.interleaved, dst[rows, blk, :, :rd]
                        )
                    else:  # several layers: through a temporary (advanced indexing copies)
                        part = src[ids, blk, :, :rd]
                        _rotate_into(part, cos, sin, self.interleaved, part)
                        dst[ids, blk, :, :rd] = part
        # Layers without RoPE: their keys as they are.
        if self.layers is not None and out is not keys:
            plain = [i for i, layer in enumerate(self.layers) if layer is None]
            if plain:
                dst[plain] = src[plain]

    def _tables(
        self, num_layers: int, delta: int, device: torch.device
    ) -> list[tuple[list[int] | None, torch.Tensor, torch.Tensor]]:
        """Per group of layers with the same frequencies: (layer ids or None for all,
        cos, sin) of ``delta * inv_freq``, float32 on ``device``, shaped to broadcast
        over ``[layers, T, heads, rotated_dims / 2]``."""
        groups: dict[RopeLayer, list[int]] = {}
        for i in range(num_layers):
            layer = self.layer(i)
            if layer is not None:
                groups.setdefault(layer, []).append(i)
        tables = []
        for layer, ids in groups.items():
            inv = _inv_freq(layer.theta, self.rotated_dims, layer.scaling).double()
            # The angle in float64 (exact for any delta a context holds), cos/sin rounded
            # once to float32: the rotation adds no more error than the model's own.
            angle = inv * float(delta)
            cos = angle.cos().float().to(device)
            sin = angle.sin().float().to(device)
            tables.append((None if len(ids) == num_layers else ids, cos, sin))
        return tables

    def _check_kv(self, kv: object, name: str) -> int:
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(kv).__name__}")
        if kv.dim() != 4 or kv.shape[0] != 2:
            raise ValueError(f"{name} has shape {list(kv.shape)}; expected [2, L, T, D] (K and V planes)")
        if not kv.dtype.is_floating_point or kv.dtype.itemsize < 2:
            raise TypeError(f"{name} has dtype {kv.dtype}; RoPE shifts need float16, bfloat16 or float32 KV")
        if kv.shape[3] % self.head_dim:
            raise ValueError(f"{name} has D = {kv.shape[3]}, not a multiple of head_dim {self.head_dim}")
        if self.layers is not None and kv.shape[1] != len(self.layers):
            raise ValueError(f"{name} has {kv.shape[1]} layers, the RopeSpec describes {len(self.layers)}")
        return int(kv.shape[3]) // self.head_dim

    # ------------------------------------------------------------------ from a config

    @classmethod
    def from_hf_config(cls, config: Any) -> RopeSpec:
        """The rotary embedding a transformers config describes, read without importing
        transformers.

        Reads either generation: transformers 5's ``rope_parameters`` (one dict, or one
        per layer type with ``layer_types``) and transformers 4's ``rope_theta`` with
        ``rope_scaling`` (plus Gemma 3's ``rope_local_base_freq`` for its sliding
        layers); ``partial_rotary_factor`` (or ``rotary_pct``/``rotary_dim``); a
        ``no_rope_layers`` list (1: the layer uses RoPE); ``head_dim`` (default
        ``hidden_size // num_attention_heads``). A multimodal config's ``text_config`` is
        used when the top level has no RoPE fields.

        Args:
            config: a ``PretrainedConfig`` or its ``to_dict()``.

        Raises:
            ValueError: dynamic NTK, LongRoPE, M-RoPE or another kind whose angle is not
                linear in the position; a config without a rotary embedding; missing
                sizes; a numeric field that is not a number (the message names it).
        """
        cfg = _as_mapping(config)
        if not _has_rope_fields(cfg) and cfg.get("text_config") is not None:
            cfg = _as_mapping(cfg["text_config"])
        model_type = str(cfg.get("model_type") or "")
        if not _has_rope_fields(cfg):
            kind = cfg.get("position_embedding_type")
            why = f" (position_embedding_type {kind!r})" if kind else ""
            raise ValueError(
                f"the config{' of ' + model_type if model_type else ''} has no rotary position "
                f"embedding{why}: its cached keys cannot be moved to other positions"
            )
        head_dim = cfg.get("head_dim")
        if not head_dim:
            try:
                head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
            except (KeyError, TypeError, ValueError):
                raise ValueError("the config lacks head_dim and hidden_size/num_attention_heads") from None
        head_dim = _int_field(head_dim, "head_dim")
        if cfg.get("rope_theta"):
            default_theta = _float_field(cfg["rope_theta"], "rope_theta")
        else:
            default_theta = _float_field(cfg.get("rotary_emb_base") or 10000.0, "rotary_emb_base")
        params = cfg.get("rope_parameters")
        layer_types = cfg.get("layer_types")
        per_type: dict[str, Mapping[str, Any]] = {}
        if isinstance(params, Mapping) and layer_types and any(k in params for k in set(layer_types)):
            per_type = {str(k): v for k, v in params.items() if isinstance(v, Mapping)}
            flat: Mapping[str, Any] = next(iter(per_type.values()))
        elif isinstance(params, Mapping) and params:
            flat = params
        else:
            flat = dict(cfg.get("rope_scaling") or {})
            flat.setdefault("rope_theta", default_theta)
        partial = flat.get("partial_rotary_factor", cfg.get("partial_rotary_factor", cfg.get("rotary_pct")))
        if cfg.get("rotary_dim"):
            rotary_dim: int | None = _int_field(cfg["rotary_dim"], "rotary_dim")
        elif partial is not None and _float_field(partial, "partial_rotary_factor") != 1.0:
            rotary_dim = int(head_dim * _float_field(partial, "partial_rotary_factor"))
        else:
            rotary_dim = None
        interleaved = model_type in _INTERLEAVED_MODELS
        max_pos = cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")
        base = _layer_from(flat, default_theta, max_pos)

        layers: list[RopeLayer | None] | None = None
        num_layers = cfg.get("num_hidden_layers")
        if per_type:
            assert layer_types is not None
            kinds = {k: _layer_from(v, default_theta, max_pos) for k, v in per_type.items()}
            missing = sorted({str(t) for t in layer_types} - set(kinds))
            if missing:
                raise ValueError(f"rope_parameters has no entry for the layer types {missing}")
            layers = [kinds[str(t)] for t in layer_types]
        elif cfg.get("rope_local_base_freq") and layer_types:  # Gemma 3 in transformers 4
            local = RopeLayer(_float_field(cfg["rope_local_base_freq"], "rope_local_base_freq"))
            layers = [local if t == "sliding_attention" else base for t in layer_types]
        no_rope = cfg.get("no_rope_layers")
        if no_rope:
            if layers is None:
                layers = [base] * len(no_rope)
            if len(no_rope) != len(layers):
                raise ValueError(f"no_rope_layers has {len(no_rope)} entries for {len(layers)} layers")
            layers = [layer if use else None for layer, use in zip(layers, no_rope, strict=True)]
        if (
            layers is not None
            and num_layers is not None
            and len(layers) != _int_field(num_layers, "num_hidden_layers")
        ):
            raise ValueError(f"the config describes RoPE for {len(layers)} of {num_layers} layers")
        uniform = layers is None or all(layer == base for layer in layers)
        return cls(
            head_dim=head_dim,
            theta=base.theta,
            rotary_dim=rotary_dim,
            interleaved=interleaved,
            scaling=base.scaling,
            layers=None if uniform or layers is None else tuple(layers),
        )


# --------------------------------------------------------------------------- helpers


MAX_DELTA: Final = 2**32
"""Bound on a position delta: ``|delta|`` must be below it (float64 angles stay exact)."""


def _check_delta(delta: object) -> None:
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(f"delta must be an int, got {type(delta).__name__}")
    if not -MAX_DELTA < delta < MAX_DELTA:
        raise ValueError(f"delta {delta} is out of range: |delta| must be below 2**32")


def _float_field(value: object, name: str) -> float:
    """``value`` as a float, or a ValueError naming the config field ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"the config's {name} must be a number, got {value!r}")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"the config's {name} must be a number, got {value!r}") from None


def _int_field(value: object, name: str) -> int:
    """``value`` as an int, or a ValueError naming the config field ``name``."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"the config's {name} must be an integer, got {value!r}")
    try:
        return int(value)  # type: ignore[call-overload,no-any-return]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"the config's {name} must be an integer, got {value!r}") from None


def _positive(value: object) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value > 0
    )


def _as_mapping(config: Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        merged = dict(to_dict())
        # transformers 5 keeps standardized fields as attributes too; attributes win.
        for key in (
            "rope_parameters",
            "rope_scaling",
            "rope_theta",
            "layer_types",
            "head_dim",
            "hidden_size",  # attribute maps (GPT-J's n_embd, n_head, n_layer) resolve here
            "num_attention_heads",
            "num_hidden_layers",
        ):
            value = getattr(config, key, None)
            if value is not None:
                merged[key] = value
        return merged
    if hasattr(config, "__dict__"):
        return dict(vars(config))
    raise TypeError(f"config must be a transformers config or a mapping, got {type(config).__name__}")


def _has_rope_fields(cfg: Mapping[str, Any]) -> bool:
    return any(
        cfg.get(key)
        for key in (
            "rope_parameters",
            "rope_theta",
            "rope_scaling",
            "rotary_emb_base",
            "rotary_dim",
            "rotary_pct",
        )
    )


def _layer_from(params: Mapping[str, Any], default_theta: float, max_pos: object) -> RopeLayer:
    """A :class:`RopeLayer` from one ``rope_parameters`` / ``rope_scaling`` dict."""
    if "mrope_section" in params or "mrope_interleaved" in params:
        raise ValueError(f"{_REFUSED['mrope']}: a shift of cached keys cannot be one rotation")
    kind = str(params.get("rope_type") or params.get("type") or "default")
    if kind in _REFUSED:
        raise ValueError(
            f"rope_type {kind!r} is refused: {_REFUSED[kind]}, so a shift of cached keys is not a "
            "rotation by the position delta"
        )
    theta = _float_field(params.get("rope_theta") or default_theta, "rope_theta")
    if kind == "default":
        return RopeLayer(theta)
    factor = params.get("factor")
    if kind == "linear":
        return RopeLayer(theta, RopeScaling("linear", _float_field(factor or 0, "factor")))
    omp = params.get("original_max_position_embeddings") or max_pos
    omp_int = int(omp) if isinstance(omp, int | float) and not isinstance(omp, bool) else None
    if kind == "llama3":
        return RopeLayer(
            theta,
            RopeScaling(
                "llama3",
                _float_field(factor or 0, "factor"),
                omp_int,
                low_freq_factor=_float_field(params.get("low_freq_factor", 1.0), "low_freq_factor"),
                high_freq_factor=_float_field(params.get("high_freq_factor", 4.0), "high_freq_factor"),
            ),
        )
    if kind == "yarn":
        if factor is None and omp_int and isinstance(max_pos, int):
            factor = max_pos / omp_int
        return RopeLayer(
            theta,
            RopeScaling(
                "yarn",
                _float_field(factor or 0, "factor"),
                omp_int,
                beta_fast=_float_field(params.get("beta_fast") or 32.0, "beta_fast"),
                beta_slow=_float_field(params.get("beta_slow") or 1.0, "beta_slow"),
                truncate=bool(params.get("truncate", True)),
            ),
        )
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3, yarn)")


def _inv_freq(theta: float, dim: int, scaling: RopeScaling | None) -> torch.Tensor:
    """The inverse frequencies, float32, as transformers' ``modeling_rope_utils`` computes
    them (the same operations in the same order, so that they are bitwise equal)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float32) / dim
    if scaling is None:
        return 1.0 / (theta**exponents)
    if scaling.kind == "linear":
        return 1.0 / (theta**exponents) / scaling.factor
    if scaling.kind == "llama3":
        inv_freq = 1.0 / (theta**exponents)
        old = scaling.original_max_position_embeddings
        assert old is not None
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        llama = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * llama / scaling.factor + smooth * llama
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, llama)
    # yarn
    omp = scaling.original_max_position_embeddings
    assert omp is not None

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(omp / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _rotate_into(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, out: torch.Tensor
) -> None:
    """Write ``x`` (``[..., rotary_dim]``) rotated pairwise by the angles of ``cos``/``sin``
    (``[rotary_dim / 2]``, float32) to ``out`` (``x``'s shape; may be ``x``): computed in
    float32, rounded once to ``out``'s dtype."""
    if interleaved:
        pairs = x.view(*x.shape[:-1], -1, 2)
        a, b = pairs[..., 0].float(), pairs[..., 1].float()
        dst = out.view(*out.shape[:-1], -1, 2)
        out_a, out_b = dst[..., 0], dst[..., 1]
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half].float(), x[..., half:].float()
        out_a, out_b = out[..., :half], out[..., half:]
    first = torch.mul(a, cos).addcmul_(b, sin, value=-1)  # a cos - b sin
    second = torch.mul(b, cos).addcmul_(a, sin)  # b cos + a sin
    out_a.copy_(first)
    out_b.copy_(second)
