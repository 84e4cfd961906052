"""Bulk remap on a Ray cluster: a Ray Data job over a JSONL file of pairs, one actor pool.

Each actor holds one client to the LMCache server of the node it runs on (from
``--server NODE_IP=URL,HTTP_URL``, or ``LMCACHE_ASYNC_URL`` / ``LMCACHE_ASYNC_HTTP_URL``
in the nodes' environment) and remaps its batches with ``remap_many``; the output is a
Parquet dataset with one row per pair (``lmcache_async.ray.OUTPUT_COLUMNS``). A job
resumes from the outputs of earlier runs (``--resume-from DIR``, repeatable): the pairs
they show done are skipped. Write each run to a new ``--output`` directory.

The input is remap-batch's JSONL with token lists (``{"source": [ids], "target": [ids],
"cache_salt": "...", "target_cache_salt": "...", "id": ...}``, the last three optional;
token ranges ``{"start", "count"}`` and ``"A:B"`` are remap-batch's only).

Run it on a cluster's head node (``ray start --head`` there, ``ray start --address ...``
on every node that runs an LMCache server)::

    python examples/ray_remap.py pairs.jsonl --model-name my-model --output out/run-1 \\
        --actors 4 --server 10.0.0.5=tcp://10.0.0.5:5555,http://10.0.0.5:8080 \\
        --server 10.0.0.6=tcp://10.0.0.6:5555,http://10.0.0.6:8080
    python examples/ray_remap.py pairs.jsonl --model-name my-model --output out/run-2 \\
        --actors 4 --resume-from out/run-1 ...

Without a cluster (``--local``) it starts a local Ray instance sized for a small machine.
To keep every actor on a host with a server, start those nodes with a custom resource
(``ray start ... --resources '{"lmcache": 1}'``) and pass ``--per-actor-resource lmcache``:
each actor then takes one unit, so there is at most one actor per such host.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Sequence

import ray
import ray.data

from lmcache_async.ray import remap_dataset, skip_done


def parse_server(text: str) -> tuple[str, tuple[str, str]]:
    """``NODE_IP=URL,HTTP_URL`` -> ``(NODE_IP, (URL, HTTP_URL))``."""
    node, sep, urls = text.partition("=")
    url, comma, http_url = urls.partition(",")
    if not (sep and comma and node and url and http_url):
        raise argparse.ArgumentTypeError(f"expected NODE_IP=URL,HTTP_URL, got {text!r}")
    return node, (url, http_url)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", help="JSONL file (or directory of them) of pairs")
    p.add_argument("--model-name", required=True)
    p.add_argument("--output", required=True, help="directory for this run's Parquet output")
    p.add_argument(
        "--resume-from", action="append", default=[], metavar="DIR", help="an earlier run's output"
    )
    p.add_argument("--server", action="append", type=parse_server, default=[], metavar="NODE_IP=URL,HTTP_URL")
    p.add_argument("--actors", type=int, default=2, help="actors in the pool (default 2)")
    p.add_argument("--batch-size", type=int, default=256, help="pairs per remap_many call (default 256)")
    p.add_argument("--concurrency", type=int, default=8, help="pairs in flight per actor (default 8)")
    p.add_argument("--max-bytes-in-flight", type=int, default=1 << 30, help="bytes per actor (default 1 GiB)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per pair (default 30)")
    p.add_argument("--per-actor-resource", metavar="NAME", help="a custom resource each actor takes 1 of")
    p.add_argument("--local", action="store_true", help="start a local Ray instance (2 CPUs, 300 MB store)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.local:
        ray.init(num_cpus=2, object_store_memory=300 << 20, include_dashboard=False)
    else:
        ray.init(address="auto")
    pairs = ray.data.read_json(args.pairs)
    if args.resume_from:
        pairs = skip_done(pairs, ray.data.read_parquet(args.resume_from))
    extra = {"resources": {args.per_actor_resource: 1}} if args.per_actor_resource else {}
    out = remap_dataset(
        pairs,
        args.model_name,
        actors=args.actors,
        batch_size=args.batch_size,
        servers=dict(args.server) or None,
        concurrency=args.concurrency,
        max_bytes_in_flight=args.max_bytes_in_flight,
        client_options={"timeout": args.timeout},
        **extra,
    )
    out.write_parquet(args.output)
    if not os.path.isdir(args.output):  # Ray writes no files for no rows
        print(f"{args.output}: nothing left to do")
        return 0
    rows = ray.data.read_parquet(args.output)
    counts = collections.Counter(r["status"] for r in rows.select_columns(["status"]).iter_rows())
    print(f"{args.output}: {dict(sorted(counts.items()))}")
    return 1 if counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
