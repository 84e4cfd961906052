"""``lmcache-async remap-batch FILE.jsonl``: many remaps, with a report, resume and progress.

* :func:`read_pairs` reads the JSONL file (one pair per line; a line that is not a valid
  pair fails on its own, the others still run);
* the pairs run through :meth:`~lmcache_async.AsyncClient.remap_many` with bounded
  concurrency and memory;
* the report (``--report``) gets one JSON line per pair as it finishes, flushed, so an
  interrupted run keeps what it did; ``--resume`` skips the pairs it shows done;
* the progress line (:func:`render_progress`) is redrawn in place on stderr and fits the
  terminal's width (:func:`terminal_columns`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

from lmcache_async._base.pair_key import pair_key, text_key
from lmcache_async.cli.arguments import (
    byte_size,
    checked_model,
    explicit_geometry,
    parse_token_spec,
    positive_int,
    server_parent,
    token_range,
)
from lmcache_async.cli.runner import (
    PROG,
    CommandError,
    UsageError,
    chunks,
    command,
    connect_client,
    emit,
    one_line,
)
from lmcache_async.cli.sharding import AutoShard, select_shard, shard_arg, shard_from_env

if TYPE_CHECKING:  # annotations only: lmcache_async.bulk imports torch, which --help must not pay
    from lmcache_async.bulk import BatchProgress, ItemResult

__all__ = ["read_pairs", "register", "render_progress", "terminal_columns"]

#: Seconds between two redraws of the progress bar.
_BAR_INTERVAL: Final = 0.1
#: Widest and narrowest bar of the progress line (characters between the brackets).
_BAR_WIDTH: Final = 24
_MIN_BAR_WIDTH: Final = 8


@dataclass(slots=True)
class _Line:
    """One line of a remap-batch input file."""

    line: int
    key: str
    pair: Any = None  # what is handed to remap_many (validated there)
    error: str | None = None  # a line that could not even be read


def _tokens_field(value: object, name: str) -> object:
    """The tokens of one side; a range (an object or a ``SPEC``) is checked against the id
    bound and ``MAX_TOKENS`` before it is built."""
    try:
        if isinstance(value, dict):
            if set(value) != {"start", "count"}:
                raise ValueError("an object needs exactly 'start' and 'count'")
            start, count = value["start"], value["count"]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (start, count)):
                raise ValueError("'start' and 'count' must be ints >= 0")
            return list(token_range(start, count))
        if isinstance(value, str):
            return parse_token_spec(value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return value  # a list (or garbage, which remap_many reports)


def read_pairs(path: Path) -> Iterator[_Line]:
    """The pairs of a remap-batch file, one per non-blank line (``#`` starts a comment).

    A line that is not UTF-8 is an invalid pair like any other (the file is decoded line
    by line: its bytes that are not UTF-8 are kept as ``surrogateescape`` does, then refused).
    """
    with open(path, encoding="utf-8", errors="surrogateescape") as fh:
        for number, raw in enumerate(fh, 1):
            text = raw.strip()
            if not text or text.startswith("#"):
                continue
            try:
                text.encode("utf-8", "surrogateescape").decode("utf-8")  # bytes not UTF-8: refused
                obj = json.loads(text)
                if not isinstance(obj, dict):
                    raise ValueError("a line must be a JSON object")
                unknown = set(obj) - {"source", "target", "cache_salt", "target_cache_salt", "id"}
                if unknown:
                    raise ValueError(f"unknown keys {sorted(unknown)}")
                if "source" not in obj or "target" not in obj:
                    raise ValueError("a line needs 'source' and 'target'")
                src = _tokens_field(obj["source"], "source")
                dst = _tokens_field(obj["target"], "target")
                salt = obj.get("cache_salt", "")
                tsalt = obj.get("target_cache_salt")
            except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
                yield _Line(number, text_key(text), error=f"invalid pair: {one_line(str(exc))}")
                continue
            except RecursionError:  # JSON nested deeper than the interpreter's recursion limit
                yield _Line(number, text_key(text), error="invalid pair: JSON nested too deeply")
                continue
            yield _Line(number, pair_key(src, dst, salt, tsalt), pair=(src, dst, salt, tsalt))


def _done_keys(report: Path) -> set[str]:
    """Keys of pairs a previous report shows finished without error (hit or miss)."""
    done: set[str] = set()
    if not report.exists():
        return done
    with open(report, encoding="utf-8") as fh:
        for raw in fh:
            with contextlib.suppress(ValueError, RecursionError):
                row = json.loads(raw)
                if isinstance(row, dict) and row.get("status") in ("hit", "miss"):
                    done.add(str(row.get("key")))
    return done


def _row(line: _Line, item: ItemResult | None) -> dict[str, Any]:
    if item is None:
        return {
            "line": line.line,
            "key": line.key,
            "status": "error",
            "retrieved_tokens": 0,
            "stored_tokens": 0,
            "stored_new": False,
            "error": line.error,
            "elapsed": 0.0,
        }
    error = None if item.error is None else f"{type(item.error).__name__}: {one_line(str(item.error))}"
    return {
        "line": line.line,
        "key": line.key,
        "status": "error" if error else "hit" if item.hit else "miss",
        "retrieved_tokens": item.retrieved_tokens,
        "stored_tokens": item.stored_tokens,
        "stored_new": item.stored_new,
        "error": error,
        "elapsed": round(item.elapsed, 6),
    }


class _ProgressBar:
    """A one-line progress bar redrawn in place on a terminal (stderr), as wide as the
    terminal allows (its width is read again at each redraw, so a resize is followed)."""

    def __init__(self, stream: IO[str], total: int, skipped: int) -> None:
        self.stream = stream
        self.total = total
        self.skipped = skipped
        self._last = 0.0

    def update(self, p: BatchProgress, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < _BAR_INTERVAL and p.done < p.total:
            return
        self._last = now
        line = render_progress(p, self.skipped, columns=terminal_columns(self.stream))
        self.stream.write("\r" + line + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def terminal_columns(stream: IO[str] | None = None) -> int | None:
    """Width of the terminal the progress line goes to, or None when there is none.

    ``COLUMNS`` first (as :func:`shutil.get_terminal_size`), then the size of ``stream``
    (stderr: the line's own terminal, also when stdout is redirected), then of stdout.
    None when neither is a terminal: a line written to a file or pipe is not cut.
    """
    size = shutil.get_terminal_size(fallback=(0, 0))  # COLUMNS, else stdout's terminal
    if "COLUMNS" not in os.environ and stream is not None:
        with contextlib.suppress(AttributeError, ValueError, OSError):
            return os.get_terminal_size(stream.fileno()).columns or None
    return size.columns or None


def render_progress(p: BatchProgress, skipped: int = 0, columns: int | None = None) -> str:
    """The progress line: bar, counts, bytes moved and throughput, e.g.
    ``[##########..............] 120/200  60%  hits 100  misses 10  failed 10  1.23 GB  3.40 GB/s``.

    With ``columns`` the line is at most ``columns - 1`` characters (the last column
    would make some terminals wrap): the bar narrows (to 8), then the throughput, the
    bytes and the skipped count are left out, and as a last resort the line is cut.
    """
    frac = p.done / p.total if p.total else 1.0
    rate = p.bytes_moved / p.elapsed / 1e9 if p.elapsed > 0 else 0.0
    fields = [
        f"{p.done}/{p.total} {frac:4.0%}",
        f"hits {p.hits}",
        f"misses {p.misses}",
        f"failed {p.failures}",
    ]
    optional = [f"skipped {skipped}"] if skipped else []
    optional += [f"{p.bytes_moved / 1e9:.2f} GB", f"{rate:.2f} GB/s"]

    def line(width: int, extra: list[str]) -> str:
        filled = int(frac * width)
        return f"[{'#' * filled}{'.' * (width - filled)}] " + "  ".join(fields + extra)

    if columns is None:
        return line(_BAR_WIDTH, optional)
    limit = max(columns - 1, 1)
    for keep in range(len(optional), -1, -1):
        over = len(line(_BAR_WIDTH, optional[:keep])) - limit
        if _BAR_WIDTH - over >= _MIN_BAR_WIDTH:
            return line(min(_BAR_WIDTH, _BAR_WIDTH - over), optional[:keep])
    return line(_MIN_BAR_WIDTH, [])[:limit]


def _remap_batch(args: argparse.Namespace) -> int:
    if args.resume and args.report is None:
        raise UsageError("--resume needs --report FILE (the report of the previous run)")
    checked_model(args.model_name)
    if isinstance(args.shard, AutoShard):
        try:
            args.shard, source = shard_from_env(os.environ, args.shard.count)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        print(f"{PROG} remap-batch: shard {source}", file=sys.stderr)
    try:
        lines = select_shard(read_pairs(args.file), args.shard, key=lambda ln: ln.key)
    except FileNotFoundError:
        raise CommandError(f"{args.file}: no such file") from None
    except OSError as exc:
        raise CommandError(f"{args.file}: {one_line(str(exc))}") from None
    done = _done_keys(args.report) if args.resume else set()
    todo = [ln for ln in lines if ln.key not in done]
    with contextlib.ExitStack() as stack:
        report: IO[str] | None = None
        if args.report is not None:
            report = stack.enter_context(open(args.report, "a" if args.resume else "w", encoding="utf-8"))
        return asyncio.run(_run_remap_batch(args, lines, todo, report))


async def _run_remap_batch(
    args: argparse.Namespace, lines: list[_Line], todo: list[_Line], report: IO[str] | None
) -> int:
    """Run the ``todo`` lines; rows go to ``report`` as each pair finishes.

    Cancellation (Ctrl-C): the pairs in flight are cancelled and clean up their server
    sessions; the rows written so far stay in the report.
    """
    skipped = len(lines) - len(todo)
    bad = [ln for ln in todo if ln.error is not None]
    work = [ln for ln in todo if ln.error is None]
    show_bar = sys.stderr.isatty() if args.progress is None else args.progress
    bar = _ProgressBar(sys.stderr, len(work), skipped) if show_bar and work else None
    failures: list[str] = []
    for ln in bad:
        _write_row(report, _row(ln, None))
        failures.append(f"line {ln.line}: {ln.error}")

    def progress(p: BatchProgress) -> None:
        ln = work[p.item.index]
        row = _row(ln, p.item)
        _write_row(report, row)
        if row["error"]:
            failures.append(f"line {ln.line}: {row['error']}")
        if bar is not None:
            bar.update(p)

    client = await connect_client(args, args.model_name, explicit_geometry(args))
    try:
        cs = client.chunk_size
        result = await client.remap_many(
            [ln.pair for ln in work],
            concurrency=args.concurrency,
            max_bytes_in_flight=args.max_bytes_in_flight,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
        await client.aclose()
    s = result.summary
    total_failures = s.failures + len(bad)
    data = {
        "file": str(args.file),
        "pairs": len(lines),
        "skipped": skipped,
        "run": len(todo),
        "hits": s.hits,
        "misses": s.misses,
        "failures": total_failures,
        "stored_new": s.stored_new,
        "retrieved_tokens": s.retrieved_tokens,
        "stored_tokens": s.stored_tokens,
        "bytes_moved": s.bytes_moved,
        "elapsed": round(s.elapsed, 6),
        "gb_per_s": round(s.gb_per_s, 4),
        "peak_bytes_in_flight": s.peak_bytes_in_flight,
        "report": None if args.report is None else str(args.report),
        "shard": None if args.shard is None else str(args.shard),
    }
    rows = [
        (
            "pairs",
            f"{len(lines)} ({skipped} skipped: done in the previous report)"
            if args.resume
            else str(len(lines)),
        ),
        ("hits", str(s.hits)),
        ("misses", str(s.misses)),
        ("failures", str(total_failures)),
        ("retrieved", chunks(s.retrieved_tokens, cs)),
        ("stored", f"{chunks(s.stored_tokens, cs)}, {s.stored_new} new"),
        ("moved", f"{s.bytes_moved} bytes"),
        ("elapsed", f"{s.elapsed:.3f} s ({s.gb_per_s:.2f} GB/s)"),
    ]
    if args.report is not None:
        rows.append(("report", str(args.report)))
    if args.shard is not None:
        rows.append(("shard", str(args.shard)))
    emit(args, data, rows)
    for message in failures[:5]:
        print(f"{PROG} remap-batch: failed: {message}", file=sys.stderr)
    if len(failures) > 5:
        more = "see the report" if args.report else "use --report FILE for all"
        print(f"{PROG} remap-batch: ... and {len(failures) - 5} more failures ({more})", file=sys.stderr)
    return 1 if total_failures else 0


def _write_row(report: IO[str] | None, row: dict[str, Any]) -> None:
    if report is not None:
        report.write(json.dumps(row, separators=(",", ":")) + "\n")
        report.flush()


def register(subparsers: Any) -> None:
    """Add ``remap-batch`` to the ``lmcache-async`` parser."""
    server = server_parent()

    p = subparsers.add_parser(
        "remap-batch",
        parents=[server],
        help="remap every pair of a JSONL file",
        description=(
            'Remap the pairs of a JSONL file, one per line: {"source": [ids] | {"start": A, '
            '"count": N} | "A:B", "target": ..., "cache_salt": "", "target_cache_salt": ""}. '
            "Blank lines and lines starting with # are ignored. Exit code 1 if any pair failed."
        ),
    )
    p.add_argument("file", type=Path, metavar="FILE.jsonl")
    p.add_argument("--model-name", required=True)
    p.add_argument("--concurrency", type=positive_int, default=8, help="pairs in flight (default 8)")
    p.add_argument(
        "--max-bytes-in-flight",
        type=byte_size,
        default=1 << 30,
        metavar="BYTES",
        help="memory budget for KV buffers, e.g. 512M, 2G (default 1G)",
    )
    p.add_argument("--report", type=Path, metavar="FILE", help="write one JSON line per pair")
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip pairs the --report file shows done (hit or miss) and append to it",
    )
    p.add_argument(
        "--shard",
        type=shard_arg,
        metavar="I/N|auto",
        help="run only shard I of N (1-based; by pair identity, see docs/guides/deployment.md); "
        "'auto' (or 'auto/N') reads I and N from a Kubernetes Indexed Job, a Slurm array or "
        "RANK/WORLD_SIZE; give each shard its own --report",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.set_defaults(func=command(_remap_batch))
