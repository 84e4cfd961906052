"""Split one bulk job into N deterministic shards, one per host.

``lmcache-async remap-batch pairs.jsonl --shard I/N`` runs only the pairs of shard
``I`` (1-based, ``1 <= I <= N``). The shard of a pair is a function of the pair's
identity alone -- the key ``remap-batch`` already gives every line (a hash of its
source, target and salts; for an unreadable line, of its text) -- never of its line
number, so:

* the N shards are disjoint and together hold every line exactly once, whatever the
  hosts, the order they run in, or their Python versions;
* a pair keeps its shard when lines are inserted, removed or reordered, so
  ``--resume`` with the shard's own ``--report`` file stays valid after editing the
  input;
* identical lines fall into the same shard.

``--shard auto`` (or ``auto/N``) reads ``I`` and ``N`` from the scheduler that started
the process (:func:`shard_from_env`): a Kubernetes Indexed Job, a Slurm job array, or a
``torchrun``-style launcher (``RANK``/``WORLD_SIZE``).

Pure functions only; nothing here touches the network.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, TypeVar

__all__ = [
    "MAX_SHARD_COUNT",
    "SHARD_COUNT_VAR",
    "AutoShard",
    "Shard",
    "parse_shard",
    "select_shard",
    "shard_arg",
    "shard_from_env",
    "shard_of",
]

T = TypeVar("T")

_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
_AUTO_RE = re.compile(r"^\s*auto\s*(?:/\s*(\d+)\s*)?$")
_INT_RE = re.compile(r"^\s*(-?\d+)\s*$")

#: The shard count of a Kubernetes Indexed Job, which Kubernetes does not put in the
#: pod's environment: set it to the Job's ``completions`` (or write ``--shard auto/N``).
SHARD_COUNT_VAR: Final = "LMCACHE_ASYNC_SHARD_COUNT"

#: The most shards a job may have (2**22, above Slurm's largest array, 4,000,001 tasks,
#: and Kubernetes' Indexed Jobs): a larger count is a typo, refused like a count of 0.
MAX_SHARD_COUNT: Final = 1 << 22


@dataclass(frozen=True, slots=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based: ``1 <= index <= count``)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        for name in ("index", "count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"shard {name} must be an int, got {type(value).__name__}")
        if self.count < 1:
            raise ValueError(f"shard count must be >= 1, got {self.count}")
        if self.count > MAX_SHARD_COUNT:
            raise ValueError(f"shard count must be at most {MAX_SHARD_COUNT}, got {self.count}")
        if not 1 <= self.index <= self.count:
            raise ValueError(f"shard index must be in 1..{self.count}, got {self.index}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def holds(self, key: str) -> bool:
        """Whether the item with identity ``key`` belongs to this shard."""
        return shard_of(key, self.count) == self.index


@dataclass(frozen=True, slots=True)
class AutoShard:
    """``--shard auto`` (``count`` None) or ``auto/N``: the shard comes from the scheduler's
    environment when the command runs (:func:`shard_from_env`)."""

    count: int | None = None

    def __post_init__(self) -> None:
        if self.count is not None and (
            isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1
        ):
            raise ValueError(f"shard count must be an int >= 1, got {self.count!r}")
        if self.count is not None and self.count > MAX_SHARD_COUNT:
            raise ValueError(f"shard count must be at most {MAX_SHARD_COUNT}, got {self.count}")

    def __str__(self) -> str:
        return "auto" if self.count is None else f"auto/{self.count}"


def parse_shard(text: str) -> Shard:
    """Parse ``"I/N"`` (e.g. ``"2/4"``) into a :class:`Shard`.

    Raises:
        ValueError: not of the form ``I/N`` with ``1 <= I <= N``.
    """
    if not isinstance(text, str):
        raise TypeError(f"a shard is a string 'I/N', got {type(text).__name__}")
    m = _SHARD_RE.match(text)
    if m is None:
        raise ValueError(f"a shard is written I/N with 1 <= I <= N (e.g. 1/4), got {text!r}")
    return Shard(int(m.group(1)), int(m.group(2)))


def shard_arg(text: str) -> Shard | AutoShard:
    """:func:`parse_shard` for ``argparse`` (``type=shard_arg``): its message on error.

    ``auto`` and ``auto/N`` give an :class:`AutoShard`, resolved by :func:`shard_from_env`.
    """
    try:
        if isinstance(text, str) and (m := _AUTO_RE.match(text)) is not None:
            return AutoShard(None if m.group(1) is None else int(m.group(1)))
        return parse_shard(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shard_of(key: str, count: int) -> int:
    """The 1-based shard (of ``count``) that the item with identity ``key`` belongs to.

    ``key`` is any string (remap-batch passes its per-line key); the result is the
    first 8 bytes of its SHA-256, big-endian, modulo ``count``, plus one -- the same
    on every machine.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"shard count must be an int >= 1, got {count!r}")
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count + 1


def select_shard(items: Iterable[T], shard: Shard | None, key: Callable[[T], str]) -> list[T]:
    """The items of ``shard`` (all of them when ``shard`` is None), in input order."""
    if shard is None:
        return list(items)
    return [item for item in items if shard.holds(key(item))]


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    """The integer value of ``env[name]``; None when unset or empty."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    m = _INT_RE.match(raw)
    if m is None:
        raise ValueError(f"{name}={raw!r} is not an integer")
    return int(m.group(1))


def _from_index(index: int, count: int, how: str) -> Shard:
    """Shard ``index + 1`` of ``count`` for the 0-based ``index`` a scheduler gives."""
    if count < 1:
        raise ValueError(f"{how}: the shard count must be >= 1, got {count}")
    if count > MAX_SHARD_COUNT:
        raise ValueError(f"{how}: the shard count must be at most {MAX_SHARD_COUNT}, got {count}")
    if not 0 <= index < count:
        raise ValueError(f"{how}: the index must be in 0..{count - 1}, got {index}")
    return Shard(index + 1, count)


def _kubernetes(env: Mapping[str, str], count: int | None) -> Shard | None:
    index = _env_int(env, "JOB_COMPLETION_INDEX")
    if index is None:
        return None
    from_env = _env_int(env, SHARD_COUNT_VAR)
    if count is not None and from_env is not None and count != from_env:
        raise ValueError(f"--shard auto/{count} and {SHARD_COUNT_VAR}={from_env} disagree")
    n = count if count is not None else from_env
    if n is None:
        raise ValueError(
            f"JOB_COMPLETION_INDEX={index} is set (a Kubernetes Indexed Job) but not the shard "
            f"count: set {SHARD_COUNT_VAR} to the Job's completions, or write --shard auto/N"
        )
    return _from_index(index, n, f"JOB_COMPLETION_INDEX={index} of {n}")


def _slurm(env: Mapping[str, str]) -> Shard | None:
    task = _env_int(env, "SLURM_ARRAY_TASK_ID")
    if task is None:
        return None
    low, high = _env_int(env, "SLURM_ARRAY_TASK_MIN"), _env_int(env, "SLURM_ARRAY_TASK_MAX")
    if low is None or high is None:
        raise ValueError(
            f"SLURM_ARRAY_TASK_ID={task} is set without SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_MAX"
        )
    step = _env_int(env, "SLURM_ARRAY_TASK_STEP") or 1
    total = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
    how = f"Slurm array task {task} of {low}-{high}" + (f":{step}" if step != 1 else "")
    if step < 1 or high < low or (high - low) % step:
        raise ValueError(f"{how}: not a range MIN-MAX[:STEP] (use --shard I/N)")
    n = (high - low) // step + 1
    if total is not None and total != n:
        raise ValueError(
            f"{how}: SLURM_ARRAY_TASK_COUNT={total} disagrees with the range ({n} tasks); "
            "an array given as a list is not a range (use --shard I/N)"
        )
    if (task - low) % step:
        raise ValueError(f"{how}: the task id is not in the range")
    return _from_index((task - low) // step, n, how)


def _torchrun(env: Mapping[str, str]) -> Shard | None:
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    if rank is None and world is None:
        return None
    if rank is None:
        raise ValueError("WORLD_SIZE is set without RANK")
    if world is None:
        raise ValueError("RANK is set without WORLD_SIZE")
    return _from_index(rank, world, f"RANK={rank} of WORLD_SIZE={world}")


#: What ``--shard auto`` reads, in the order of the messages.
_SCHEDULERS: Final = (
    ("Kubernetes Indexed Job", "JOB_COMPLETION_INDEX"),
    ("Slurm array", "SLURM_ARRAY_TASK_ID"),
    ("torchrun", "RANK/WORLD_SIZE"),
)


def shard_from_env(env: Mapping[str, str], count: int | None = None) -> tuple[Shard, str]:
    """The shard of this process from its scheduler's environment (``--shard auto``).

    Read, each only when its index variable is set (indices are 0-based, shards 1-based):

    * Kubernetes Indexed Job: ``JOB_COMPLETION_INDEX``; the count is ``count``
      (``--shard auto/N``) or :data:`SHARD_COUNT_VAR` (``LMCACHE_ASYNC_SHARD_COUNT``),
      which the Job sets to its ``completions`` -- Kubernetes does not export it;
    * Slurm job array: ``SLURM_ARRAY_TASK_ID`` within ``SLURM_ARRAY_TASK_MIN`` ..
      ``SLURM_ARRAY_TASK_MAX`` (step ``SLURM_ARRAY_TASK_STEP``, default 1), checked
      against ``SLURM_ARRAY_TASK_COUNT`` when set; an array that is not a range (``--array
      1,3,7``) is refused;
    * ``torchrun`` and launchers like it: ``RANK`` of ``WORLD_SIZE``.

    When several are set (``torchrun`` under Slurm) they must give the same shard; a
    ``count`` must equal every scheduler's own count.

    Args:
        env: the environment (``os.environ``).
        count: the count written in ``--shard auto/N``, or None.

    Returns:
        The shard and a line saying where it came from, e.g.
        ``"2/4 from Slurm array (SLURM_ARRAY_TASK_ID)"``.

    Raises:
        ValueError: no scheduler variable is set, a value is not an integer or out of
            range, or two sources disagree (the message names the variables).
    """
    found: list[tuple[str, str, Shard]] = []
    for (name, variables), shard in zip(
        _SCHEDULERS, (_kubernetes(env, count), _slurm(env), _torchrun(env)), strict=True
    ):
        if shard is not None:
            found.append((name, variables, shard))
    if not found:
        listed = ", ".join(f"{v} ({n})" for n, v in _SCHEDULERS)
        raise ValueError(f"--shard auto: no scheduler variable is set; looked for {listed}")
    if len({shard for _, _, shard in found}) > 1:
        said = "; ".join(f"{n} ({v}) says {s}" for n, v, s in found)
        raise ValueError(f"--shard auto: the schedulers disagree: {said}")
    shard = found[0][2]
    if count is not None and shard.count != count:
        raise ValueError(f"--shard auto/{count}: {found[0][0]} ({found[0][1]}) says {shard.count} shards")
    sources = ", ".join(f"{n} ({v})" for n, v, _ in found)
    return shard, f"{shard} from {sources}"
