"""Unit tests of lmcache_async.cli.sharding (the pure part of remap-batch --shard)."""

from __future__ import annotations

import argparse
import hashlib

import pytest
from hypothesis import given, strategies as st

from lmcache_async.cli.sharding import (
    SHARD_COUNT_VAR,
    AutoShard,
    Shard,
    parse_shard,
    select_shard,
    shard_arg,
    shard_from_env,
    shard_of,
)


@pytest.mark.parametrize(
    ("text", "index", "count"),
    [
        ("1/1", 1, 1),
        ("1/4", 1, 4),
        ("4/4", 4, 4),
        (" 2 / 3 ", 2, 3),
        ("10/12", 10, 12),
        ("4194304/4194304", 4194304, 4194304),
    ],
)
def test_parse_shard(text: str, index: int, count: int) -> None:
    shard = parse_shard(text)
    assert shard == Shard(index, count)
    assert str(shard) == f"{index}/{count}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0/4", "shard index must be in 1..4, got 0"),
        ("5/4", "shard index must be in 1..4, got 5"),
        ("1/0", "shard count must be >= 1, got 0"),
        ("1/4194305", "shard count must be at most 4194304, got 4194305"),
        ("1/99999999999999999999", "shard count must be at most 4194304, got 99999999999999999999"),
        ("1", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got '1'"),
        ("a/b", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got 'a/b'"),
        ("-1/4", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got '-1/4'"),
        ("1/4/2", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got '1/4/2'"),
        ("", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got ''"),
    ],
)
def test_parse_shard_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^(shard|a shard)") as info:
        parse_shard(text)
    assert str(info.value) == message


def test_shard_type_errors() -> None:
    with pytest.raises(TypeError, match="shard index must be an int, got bool"):
        Shard(True, 2)
    with pytest.raises(TypeError, match="a shard is a string 'I/N', got int"):
        parse_shard(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shard count must be an int >= 1, got 0"):
        shard_of("k", 0)


def test_shard_of_is_the_documented_hash() -> None:
    # The documented function, written out: first 8 bytes of SHA-256, big-endian, mod N, + 1.
    for key in ("", "abc", "0123456789abcdef0123", "päir"):
        digest = hashlib.sha256(key.encode()).digest()
        for n in (1, 2, 3, 7, 64):
            assert shard_of(key, n) == int.from_bytes(digest[:8], "big") % n + 1
    # Fixed values, so a change of the function (which would re-shard running jobs) fails.
    assert [shard_of(f"pair-{i}", 4) for i in range(12)] == [1, 3, 3, 2, 3, 2, 4, 2, 2, 4, 4, 4]
    assert (shard_of("abc", 4), shard_of("abc", 7)) == (3, 3)


@given(st.lists(st.text(max_size=12), max_size=60), st.integers(min_value=1, max_value=9))
def test_shards_partition_the_input(keys: list[str], n: int) -> None:
    items = list(enumerate(keys))
    parts = [select_shard(items, Shard(i, n), key=lambda it: it[1]) for i in range(1, n + 1)]
    # Disjoint, complete, each in input order.
    assert sorted(x for part in parts for x in part) == items
    for part in parts:
        assert part == sorted(part)
    # Identical keys share a shard.
    for part in parts:
        inside = {k for _, k in part}
        assert all(k not in inside for other in parts if other is not part for _, k in other)


@given(st.lists(st.text(max_size=12), unique=True, max_size=40), st.integers(min_value=1, max_value=6))
def test_shard_does_not_depend_on_position(keys: list[str], n: int) -> None:
    shard = Shard(1, n)
    forward = select_shard(keys, shard, key=str)
    backward = select_shard(list(reversed(keys)), shard, key=str)
    assert forward == list(reversed(backward))
    assert select_shard(keys, None, key=str) == keys


def test_shards_are_balanced_enough() -> None:
    keys = [hashlib.sha256(str(i).encode()).hexdigest()[:20] for i in range(4000)]
    sizes = [len(select_shard(keys, Shard(i, 4), key=str)) for i in range(1, 5)]
    assert sum(sizes) == 4000
    assert min(sizes) > 900  # 1000 expected each; a broken hash puts everything in one


# --------------------------------------------------------------------------- --shard auto

K8S = "Kubernetes Indexed Job (JOB_COMPLETION_INDEX)"
SLURM = "Slurm array (SLURM_ARRAY_TASK_ID)"
TORCHRUN = "torchrun (RANK/WORLD_SIZE)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("auto", AutoShard()),
        (" auto ", AutoShard()),
        ("auto/4", AutoShard(4)),
        ("auto / 2", AutoShard(2)),
        ("2/4", Shard(2, 4)),
    ],
)
def test_shard_arg_auto(text: str, expected: Shard | AutoShard) -> None:
    assert shard_arg(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("auto/0", "shard count must be an int >= 1, got 0"),
        ("auto/4194305", "shard count must be at most 4194304, got 4194305"),
        ("auto/x", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got 'auto/x'"),
        ("Auto", "a shard is written I/N with 1 <= I <= N (e.g. 1/4), got 'Auto'"),
    ],
)
def test_shard_arg_auto_rejects(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        shard_arg(text)
    assert str(info.value) == message
    assert str(AutoShard()) == "auto" and str(AutoShard(3)) == "auto/3"


@pytest.mark.parametrize(
    ("env", "count", "shard", "source"),
    [
        # Kubernetes Indexed Job: 0-based index, the count from the variable or auto/N.
        ({"JOB_COMPLETION_INDEX": "0", SHARD_COUNT_VAR: "2"}, None, Shard(1, 2), K8S),
        ({"JOB_COMPLETION_INDEX": "3", SHARD_COUNT_VAR: "4"}, None, Shard(4, 4), K8S),
        ({"JOB_COMPLETION_INDEX": "1"}, 3, Shard(2, 3), K8S),
        ({"JOB_COMPLETION_INDEX": "1", SHARD_COUNT_VAR: "3"}, 3, Shard(2, 3), K8S),
        # Slurm arrays: --array=0-3, --array=1-4, --array=0-15:4 (step).
        (
            {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "3",
             "SLURM_ARRAY_TASK_COUNT": "4"},
            None, Shard(3, 4), SLURM,
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "4",
             "SLURM_ARRAY_TASK_COUNT": "4"},
            4, Shard(1, 4), SLURM,
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "12",
             "SLURM_ARRAY_TASK_STEP": "4", "SLURM_ARRAY_TASK_COUNT": "4"},
            None, Shard(4, 4), SLURM,
        ),
        ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "5", "SLURM_ARRAY_TASK_MAX": "5"}, None,
         Shard(1, 1), SLURM),
        # torchrun.
        ({"RANK": "0", "WORLD_SIZE": "1"}, None, Shard(1, 1), TORCHRUN),
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, None, Shard(6, 8), TORCHRUN),
        ({"RANK": " 1 ", "WORLD_SIZE": "2"}, 2, Shard(2, 2), TORCHRUN),
        # Two that agree (torchrun in a one-node-per-task Slurm array).
        (
            {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "1",
             "RANK": "1", "WORLD_SIZE": "2"},
            None, Shard(2, 2), f"{SLURM}, {TORCHRUN}",
        ),
        # Empty variables count as unset.
        ({"JOB_COMPLETION_INDEX": "", "RANK": "0", "WORLD_SIZE": "3"}, None, Shard(1, 3), TORCHRUN),
    ],
)  # fmt: skip
def test_shard_from_env(env: dict[str, str], count: int | None, shard: Shard, source: str) -> None:
    assert shard_from_env(env, count) == (shard, f"{shard} from {source}")


@pytest.mark.parametrize(
    ("env", "count", "message"),
    [
        (
            {"PATH": "/bin", "LOCAL_RANK": "0"},
            None,
            "--shard auto: no scheduler variable is set; looked for JOB_COMPLETION_INDEX (Kubernetes "
            "Indexed Job), SLURM_ARRAY_TASK_ID (Slurm array), RANK/WORLD_SIZE (torchrun)",
        ),
        (
            {"JOB_COMPLETION_INDEX": "1"},
            None,
            "JOB_COMPLETION_INDEX=1 is set (a Kubernetes Indexed Job) but not the shard count: set "
            "LMCACHE_ASYNC_SHARD_COUNT to the Job's completions, or write --shard auto/N",
        ),
        (
            {"JOB_COMPLETION_INDEX": "1", SHARD_COUNT_VAR: "4"},
            3,
            "--shard auto/3 and LMCACHE_ASYNC_SHARD_COUNT=4 disagree",
        ),
        (
            {"JOB_COMPLETION_INDEX": "2", SHARD_COUNT_VAR: "2"},
            None,
            "JOB_COMPLETION_INDEX=2 of 2: the index must be in 0..1, got 2",
        ),
        ({"JOB_COMPLETION_INDEX": "one", SHARD_COUNT_VAR: "2"}, None, "JOB_COMPLETION_INDEX='one' is not an integer"),
        ({"JOB_COMPLETION_INDEX": "0", SHARD_COUNT_VAR: "0"}, None,
         "JOB_COMPLETION_INDEX=0 of 0: the shard count must be >= 1, got 0"),
        ({"JOB_COMPLETION_INDEX": "0", SHARD_COUNT_VAR: "99999999999999999999"}, None,  # QA-4 n6
         "JOB_COMPLETION_INDEX=0 of 99999999999999999999: the shard count must be at most 4194304, "
         "got 99999999999999999999"),
        ({"RANK": "0", "WORLD_SIZE": "4194305"}, None,
         "RANK=0 of WORLD_SIZE=4194305: the shard count must be at most 4194304, got 4194305"),
        (
            {"SLURM_ARRAY_TASK_ID": "3"},
            None,
            "SLURM_ARRAY_TASK_ID=3 is set without SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_MAX",
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "7",
             "SLURM_ARRAY_TASK_COUNT": "3"},
            None,
            "Slurm array task 3 of 1-7: SLURM_ARRAY_TASK_COUNT=3 disagrees with the range (7 tasks); "
            "an array given as a list is not a range (use --shard I/N)",
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "8",
             "SLURM_ARRAY_TASK_STEP": "4"},
            None,
            "Slurm array task 2 of 0-8:4: the task id is not in the range",
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "7",
             "SLURM_ARRAY_TASK_STEP": "4"},
            None,
            "Slurm array task 2 of 0-7:4: not a range MIN-MAX[:STEP] (use --shard I/N)",
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_MAX": "3"},
            None,
            "Slurm array task 9 of 0-3: the index must be in 0..3, got 9",
        ),
        ({"RANK": "1"}, None, "RANK is set without WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, None, "WORLD_SIZE is set without RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, None, "RANK=2 of WORLD_SIZE=2: the index must be in 0..1, got 2"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, None, "RANK=-1 of WORLD_SIZE=2: the index must be in 0..1, got -1"),
        ({"RANK": "0", "WORLD_SIZE": "4"}, 2, "--shard auto/2: torchrun (RANK/WORLD_SIZE) says 4 shards"),
        (
            {"JOB_COMPLETION_INDEX": "0", SHARD_COUNT_VAR: "2", "RANK": "1", "WORLD_SIZE": "2"},
            None,
            "--shard auto: the schedulers disagree: Kubernetes Indexed Job (JOB_COMPLETION_INDEX) says 1/2; "
            "torchrun (RANK/WORLD_SIZE) says 2/2",
        ),
    ],
)  # fmt: skip
def test_shard_from_env_rejects(env: dict[str, str], count: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=r".") as info:
        shard_from_env(env, count)
    assert str(info.value) == message
