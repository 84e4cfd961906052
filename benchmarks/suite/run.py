"""The whole benchmark suite in one command: ``make bench`` (or ``make bench-quick``).

    .venv/bin/python -m benchmarks.suite [--quick] [--generation 0.5.6|0.5.7]
        [--sections rtt facade concurrent single_shm fresh untouched remap compose observe single_pickle
                    quality fleet] [--no-render]
        [--out DIR]

``BENCH_QUICK=1`` in the environment is the same as ``--quick``. Starts the real LMCache
server(s) itself (from ``.lmcache-venv``; ``--generation 0.5.7``: ``.lmcache-venv-057``),
one SHM server shared by the SHM sections and one without SHM for ``single_pickle``, runs
each section (each alternates the official SDK and lmcache_async within the run; see the
section's module for its method), writes ``benchmarks/results/<version>/<section>.json``
(``<version>``: lmcache_async's; 0.5.7: ``<section>-0.5.7.json``) as soon as the section is
done, stamped with the machine, the versions and the commit, and finally renders
``docs/benchmarks.md`` and ``docs/img/*.png`` from that directory and the notes in
``benchmarks/suite/notes/`` (``benchmarks/suite/render.py``; needs the ``bench`` extra:
matplotlib).

Sections (module, what):

* ``rtt`` (bench_rtt.py): a bare blocking DEALER vs our client, ``noop`` / ``end_session``;
* ``facade`` (bench_facade.py): ``Client.x()`` vs ``await AsyncClient.x()``;
* ``concurrent`` (bench_concurrent.py): 256 one-chunk (256 KiB) retrieves and stores, one
  AsyncClient at concurrency 1/8/64 vs one SDK context on 1/8 threads; ops/s, CPU/op;
* ``single_shm`` / ``single_pickle`` (bench_client.py): store, retrieve, retrieve into
  ``out=`` at 1/4/16 chunks of 32 MiB, plus the store + retrieve of a tiny (16 KiB) chunk;
* ``fresh`` (bench_fresh.py): the 16-chunk retrieve into ``out=`` right after connect;
* ``untouched`` (bench_untouched.py): stores into pool pages nobody has written yet, and
  retrieves of KV another process stored, each side through a fresh mapping;
* ``remap`` (bench_remap_batch.py): ``remap_many`` vs the SDK's retrieve + store loop;
* ``compose`` (bench_compose.py): ``compose`` of a 16-chunk target from two parts vs a
  ``remap`` of the same size plus the rotation alone (no SDK counterpart);
* ``observe`` (bench_observe.py): client CPU per small retrieve with observation off, a
  do-nothing hook, and OpenTelemetry spans and metrics (no SDK counterpart);
* ``quality`` (bench_quality.py): composed prompts on the trained model (SmolLM2-135M-Instruct,
  on the CPU, its KV on an embedded server; no real server, no SDK counterpart): answer
  accuracy, greedy agreement and KL to the full prefill for plain composition, the first-k
  and the selective repair, and the time to first token at 1k-4k tokens (the full profile:
  50 sets, about 20 minutes on 2 CPUs).
* ``fleet`` (bench_fleet.py): KV events one subscriber keeps up with, the prefix index's
  lookup time and memory per chunk, a routed retrieve vs asking every server (two
  servers of its own, chunk size 16; no SDK counterpart).

The quick profile (fewer iterations, rounds and remap pairs) proves the pipeline in a few
minutes; its figures are marked as such on the page. Only the single-operation sections
run against 0.5.7. Exit status: 0 when every section ran, 1 otherwise (the results of the
sections that ran are written all the same).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.harness import GENERATIONS, server_python, stamp, start_servers
from benchmarks.suite import (
    RESULTS_DIR,
    bench_client,
    bench_compose,
    bench_concurrent,
    bench_facade,
    bench_fleet,
    bench_fresh,
    bench_observe,
    bench_quality,
    bench_remap_batch,
    bench_rtt,
    bench_untouched,
)
from harness.real_server import RealLMCacheServer

SHM_SECTIONS = (
    "rtt",
    "facade",
    "concurrent",
    "single_shm",
    "fresh",
    "untouched",
    "remap",
    "compose",
    "observe",
)
#: Sections that start no server (the trained model's, on an embedded server).
LOCAL_SECTIONS = ("quality",)
ALL_SECTIONS = (*SHM_SECTIONS, "single_pickle", *LOCAL_SECTIONS, "fleet")
GEN057_SECTIONS = ("single_shm", "single_pickle")

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {  # proves the pipeline in a few minutes: fewer cases, one counted round
        "shm_l1_gb": 4,
        "pickle_l1_gb": 2,
        "rtt": {"n": 200, "rounds": 2},
        "facade": {"iters": 100, "rounds": 2},
        "concurrent": {
            "prompts": 256,
            "rounds": 1,
            "concurrency": [1, 8, 64],
            "threads": [1, 8],
            "ops": ["retrieve"],
        },
        "single": {"chunks": [1, 4], "iters": 2, "rounds": 1},
        "single_pickle": {"chunks": [1], "iters": 2, "rounds": 1},
        "fresh": {"reps": 2, "settle": 0.0},
        "untouched": {"chunks": [1, 4], "iters": 2, "rounds": 1},
        "remap": {"pairs": 8, "rounds": 1},
        "compose": {"layers": 8, "iters": 3, "rounds": 1},
        "observe": {"prompts": 256, "rounds": 1, "concurrency": [8, 64]},
        "quality": {"sets": 8, "new_tokens": 16, "contexts": [1024], "reps": 1},
        "fleet": {"events": 4096, "rounds": 1, "prompts": 16, "index_chunks": 1_000_000},
    },
    "full": {
        "shm_l1_gb": 10,
        "pickle_l1_gb": 8,
        "rtt": {"n": 300, "rounds": 3},
        "facade": {"iters": 1000, "rounds": 3},
        "concurrent": {
            "prompts": 256,
            "rounds": 3,
            "concurrency": [1, 8, 64],
            "threads": [1, 8],
            "ops": ["retrieve", "store"],
        },
        "single": {"chunks": [1, 4, 16], "iters": 8, "rounds": 3},
        "single_pickle": {"chunks": [1, 4, 16], "iters": 4, "rounds": 3},  # inline 512 MiB: seconds a call
        "fresh": {"reps": 5, "settle": 6.0},
        "untouched": {"chunks": [1, 4, 16], "iters": 3, "rounds": 3},
        "remap": {"pairs": 64, "rounds": 3},
        "compose": {"layers": 32, "iters": 4, "rounds": 3},
        "observe": {"prompts": 256, "rounds": 5, "concurrency": [8, 64]},
        "quality": {"sets": 50, "new_tokens": 16, "contexts": [1024, 2048, 4096], "reps": 2},
        "fleet": {"events": 16384, "rounds": 3, "prompts": 64, "index_chunks": 1_000_000},
    },
}


def _run_section(name: str, shm: RealLMCacheServer | None, pickle: RealLMCacheServer | None,
                 python: Path, prof: dict[str, Any], generation: str) -> dict[str, Any]:  # fmt: skip
    if name == "quality":
        return bench_quality.section(**prof["quality"])
    if name == "single_pickle":
        assert pickle is not None
        return bench_client.section(pickle, python=python, generation=generation, **prof["single_pickle"])
    if name == "fleet":  # two servers of its own (chunk size 16)
        return bench_fleet.section(python=python, **prof["fleet"])
    assert shm is not None
    if name == "single_shm":
        return bench_client.section(shm, python=python, generation=generation, **prof["single"])
    if name == "rtt":
        return bench_rtt.section(shm.url, shm.http_url, **prof["rtt"])
    if name == "facade":
        return bench_facade.section(shm.url, shm.http_url, **prof["facade"])
    if name == "concurrent":
        return bench_concurrent.section(shm, python=python, **prof["concurrent"])
    if name == "fresh":
        return bench_fresh.section(shm, python=python, l1_gb=prof["shm_l1_gb"], **prof["fresh"])
    if name == "untouched":
        return bench_untouched.section(shm, python=python, **prof["untouched"])
    if name == "remap":
        return bench_remap_batch.section(shm, python=python, l1_gb=prof["shm_l1_gb"], **prof["remap"])
    if name == "compose":
        urls = {"shm": (shm.url, shm.http_url)}
        if pickle is not None and pickle.is_running():
            urls["pickle"] = (pickle.url, pickle.http_url)
        return bench_compose.section(urls, **prof["compose"])
    if name == "observe":
        return bench_observe.section(shm, **prof["observe"])
    raise ValueError(name)


def result_path(out: Path, name: str, generation: str) -> Path:
    return out / (f"{name}.json" if generation == "0.5.6" else f"{name}-{generation}.json")


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", default=os.environ.get("BENCH_QUICK", "") not in ("", "0")
    )
    parser.add_argument("--generation", choices=GENERATIONS, default="0.5.6")
    parser.add_argument("--sections", nargs="+", choices=ALL_SECTIONS)
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR,
        help=f"where the JSON goes (default {RESULTS_DIR}; the page is rendered from the default)",
    )
    parser.add_argument("--no-render", action="store_true", help="write the JSON only")
    args = parser.parse_args()
    gen = args.generation
    sections = list(args.sections or (ALL_SECTIONS if gen == "0.5.6" else GEN057_SECTIONS))
    if gen != "0.5.6" and (bad := [s for s in sections if s not in GEN057_SECTIONS]):
        parser.error(f"--generation {gen} runs only {', '.join(GEN057_SECTIONS)}, not {', '.join(bad)}")
    profile = "quick" if args.quick else "full"
    prof = PROFILES[profile]
    python = server_python(gen)
    args.out.mkdir(parents=True, exist_ok=True)

    shm = pickle = None
    if any(s in SHM_SECTIONS for s in sections):
        shm = bench_remap_batch.server(python, prof["shm_l1_gb"])
    if "single_pickle" in sections:
        pickle = RealLMCacheServer(
            "pickle", venv_python=python, chunk_size=256, l1_size_gb=prof["pickle_l1_gb"]
        )
    failed: list[str] = []
    t_start = time.monotonic()
    print(f"benchmark suite ({profile}, server {gen}): {', '.join(sections)}", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        servers = [s for s in (shm, pickle) if s is not None]
        start_servers(servers)
        for s in servers:
            stack.callback(s.stop)
        for i, name in enumerate(sections):
            todo = sections[i:]
            t0 = time.monotonic()
            print(f"[{name}] ...", file=sys.stderr)
            head = stamp(gen, profile=profile)
            if shm in servers and not any(n in SHM_SECTIONS for n in todo):
                shm.stop()  # no SHM section left: give its pool's memory back before the inline one
                servers.remove(shm)
            for s in servers:
                if not s.is_running():  # e.g. killed for memory during the previous section
                    print(f"[{name}] restarting the {s.mode} server (it died)", file=sys.stderr)
                    s.restart(timeout=120)
            try:
                result = _run_section(name, shm, pickle, python, prof, gen)
            except Exception:
                traceback.print_exc()
                failed.append(name)
                continue
            head["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
            head["seconds"] = round(time.monotonic() - t0, 1)
            doc = {
                "section": name,
                "stamp": head,
                "params": prof.get(name, prof.get(name.split("_")[0], {})),
                "result": result,
            }
            path = result_path(args.out, name, gen)
            path.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"[{name}] done in {head['seconds']} s -> {path}", file=sys.stderr)
    print(f"suite: {time.monotonic() - t_start:.0f} s; failed: {failed or 'none'}", file=sys.stderr)
    if not args.no_render:
        from benchmarks.suite import render

        render.main([])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
