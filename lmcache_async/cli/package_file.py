"""KV package files: the official SDK example's ``torch.save`` of one prompt's KV.

A package is ``torch.save({"kv": tensor [2, L, T, D] (or [L, T, D] for MLA),
"model_name": str, "tokens": [T ints in [0, 2**32)], "cache_salt": str})``.
:func:`load_package` reads one with ``torch.load(weights_only=True)`` only, so a file
that needs anything but tensors, strings, numbers, lists and dicts is refused before it
is unpickled further; every field is checked as the server would check it.
:func:`check_output` refuses a path :func:`save_package` could not write, before the
package is made or fetched.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
from torch.serialization import MAGIC_NUMBER

from lmcache_async._protocol.wire import validate_cache_salt, validate_model_name, validate_tokens
from lmcache_async.cli.runner import CommandError, one_line

__all__ = ["PACKAGE_FORMAT", "Package", "check_output", "load_package", "save_package"]

#: What a KV package file is, for error messages.
PACKAGE_FORMAT: Final = (
    'a KV package is a torch.save of {"kv": [2, L, T, D] tensor, "model_name": str, '
    '"tokens": [T token ids], "cache_salt": str}, as written by make-package or retrieve'
)


@dataclass(frozen=True, slots=True)
class Package:
    """A KV package file: ``kv`` ``[2, L, T, D]`` for ``tokens`` of ``model_name``."""

    kv: torch.Tensor
    model_name: str
    tokens: list[int]
    cache_salt: str


def load_package(path: str | os.PathLike[str]) -> Package:
    """Read a KV package written by the official example's ``make-package`` (or ours).

    Only ``torch.load(..., weights_only=True)`` is used: a file that needs anything but
    tensors, strings, ints, lists and dicts is refused, with a message that says what a
    package is (not torch's advice to load it unsafely, nor its warnings about the file).

    Raises:
        CommandError: missing or unreadable, not a package, or a package whose fields the
            server would refuse (negative or too large token ids, a salt or model name with
            ``@``, a ``kv`` that does not hold one row per token).
    """
    try:
        with warnings.catch_warnings():
            # The weights_only unpickler warns about the protocol of a plain pickle before it
            # refuses it: the one-line error below says what the file is.
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch(\.|$)")
            obj = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CommandError(f"{path}: no such file") from None
    except OSError as exc:  # a directory, no permission, ...
        raise CommandError(f"{path}: {one_line(exc.strerror or str(exc))}") from None
    except Exception as exc:
        # The weights_only unpickler refuses a torch.save file that holds a class or a
        # function, but also a plain pickle or a text file: only the layout tells them apart.
        if isinstance(exc, pickle.UnpicklingError) and _torch_save_layout(path):
            raise CommandError(
                f"{path}: not a KV package: it holds objects other than tensors, strings, numbers, "
                f"lists and dicts, so it was not loaded ({PACKAGE_FORMAT})"
            ) from None
        # torch's many ways of saying "not a torch.save file"
        raise CommandError(
            f"{path}: not a KV package: not a file written by torch.save ({PACKAGE_FORMAT})"
        ) from None
    if not isinstance(obj, dict):
        raise CommandError(
            f"{path}: not a KV package: it holds a {type(obj).__name__}, not a dict ({PACKAGE_FORMAT})"
        )
    missing = [k for k in ("kv", "model_name", "tokens") if k not in obj]
    if missing:
        raise CommandError(f"{path}: not a KV package: no {', '.join(missing)} ({PACKAGE_FORMAT})")
    kv, model, tokens, salt = obj["kv"], obj["model_name"], obj["tokens"], obj.get("cache_salt", "")
    if not isinstance(kv, torch.Tensor) or kv.dim() not in (3, 4):
        raise CommandError(f"{path}: 'kv' must be a [2, L, T, D] tensor")
    if not isinstance(model, str) or not isinstance(salt, str):
        raise CommandError(f"{path}: 'model_name' and 'cache_salt' must be strings")
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    if not isinstance(tokens, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise CommandError(f"{path}: 'tokens' must be a list of ints")
    try:
        tokens = validate_tokens(tokens, "'tokens'")
        validate_model_name(model)
        validate_cache_salt(salt, "'cache_salt'")
    except ValueError as exc:
        raise CommandError(f"{path}: {exc}") from None
    axis = kv.dim() - 2
    if kv.shape[axis] != len(tokens):
        raise CommandError(f"{path}: 'kv' holds {kv.shape[axis]} tokens but 'tokens' has {len(tokens)}")
    return Package(kv, model, tokens, salt)


def _torch_save_layout(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is laid out as torch.save writes: a zip archive (the format since
    torch 1.6), or the legacy format, which starts with a pickle of torch's magic number.
    Only the layout is read: nothing is unpickled."""
    if zipfile.is_zipfile(path):
        return True
    with open(path, "rb") as fh:
        head = fh.read(64)
    return any(
        head.startswith(pickle.dumps(MAGIC_NUMBER, protocol=p)) for p in range(pickle.HIGHEST_PROTOCOL + 1)
    )


def check_output(path: Path) -> None:
    """Refuse an output path that cannot be written: its directory does not exist (or is
    not a directory), or it is a directory itself.

    Raises:
        CommandError: naming the path and why.
    """
    if path.is_dir():
        raise CommandError(f"{path}: cannot write: it is a directory")
    parent = path.parent
    if not parent.exists():
        raise CommandError(f"{path}: cannot write: no such directory {parent}")
    if not parent.is_dir():
        raise CommandError(f"{path}: cannot write: {parent} is not a directory")


def save_package(path: str | os.PathLike[str], package: Package) -> None:
    """Write ``package`` in the official example's format.

    Raises:
        CommandError: the file cannot be written (its directory does not exist, the disk
            is full, ...).
    """
    # Through a Python file: torch's own file writer reports a failed write as
    # "basic_ios::clear: iostream error", where a Python file raises the OSError that says why.
    try:
        with open(path, "wb") as fh:
            torch.save(
                {
                    "kv": package.kv.contiguous(),
                    "model_name": package.model_name,
                    "tokens": list(package.tokens),
                    "cache_salt": package.cache_salt,
                },
                fh,
            )
    except OSError as exc:
        raise CommandError(f"{path}: cannot write: {one_line(exc.strerror or str(exc))}") from None
    except RuntimeError as exc:  # torch's file writer reports its failures as RuntimeError
        raise CommandError(f"{path}: cannot write: {one_line(str(exc))}") from None
