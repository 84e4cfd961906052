"""Documents cached alone at position 0, or behind the system prompt: which composes better?

    .venv/bin/python -m benchmarks.probes.quality_protocol [--sets 16] [--variants plain,first_k,base@0.15]

The quality section's corpus and model, as ``benchmarks.probes.quality_selection``; per set
both protocols: ``alone`` (each document cached alone at positions 0.., as the section did
first) and ``prefix`` (each document cached behind the system prompt, ``prefix + doc``, and
composed from its own positions; the first document is then the full prefill's KV). Each
variant (``name@fraction``; names of ``quality_selection.repair``, ``first_k``) repairs a copy
of the plain composition in this process; the prompt is served from it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import torch

from benchmarks.probes import quality_selection as qs
from benchmarks.suite import bench_quality as bq
from benchmarks.suite.quality_corpus import corpus
from lmcache_async import AsyncClient, KVPart, RopeSpec, hf
from lmcache_async.testing import EmbeddedServer, trained


def first_k(model: Any, toks: list[int], kv: torch.Tensor, spans: list[tuple[int, int]], k: int) -> list[int]:
    g = hf.geometry_from_model(model)
    out: list[int] = []
    for a, b in spans:
        b = min(b, a + k)
        cache = hf.kv_to_cache(kv[:, :, :a], g, config=model.config)
        hf._forward(model, toks[a:b], cache, a)
        kv[:, :, a:b].copy_(hf.cache_to_kv(cache, g)[:, :, a:b])
        out += range(a, b)
    return out


async def run(sets: int, variants: list[str], protocols: list[str]) -> dict[str, dict[str, float]]:
    model = trained.smollm2()
    tok = trained.smollm2_tokenizer()
    eos = tok.eos_token_id
    g = hf.geometry_from_model(model)
    prefix = bq._tokens(bq.PREFIX)
    rows: dict[str, list[tuple[bool, bool, float, float]]] = {"full": []}
    seconds: dict[str, float] = {}
    async with EmbeddedServer(chunk_size=bq.CS, mode="shm", size_bytes=g.bytes_per_token * 80_000) as srv:
        async with AsyncClient(
            srv.url, srv.http_url, f"proto-{time.time_ns()}", geometry=g, timeout=600
        ) as c:
            rope = RopeSpec.from_hf_config(model.config)
            for i, s in enumerate(corpus(50)[:sets]):
                docs = [bq._tokens(d) for d in s.documents]
                target = [t for p in (prefix, *docs) for t in p] + bq._question(s.question)
                full = await hf.run_model(hf.generate, model, target, max_new_tokens=16, eos_token_id=eos)
                rows["full"].append((s.answer.lower() in tok.decode(full.tokens).lower(), True, 0.0, 1.0))
                ndoc = sum(len(d) for d in docs)
                for proto in protocols:
                    if proto == "alone":
                        parts = await bq._cache_alone(c, model, [prefix, *docs])
                        exact = len(prefix)
                    else:
                        parts = []
                        for j, d in enumerate(docs):
                            src = bq._padded(prefix + d)
                            if await c.lookup(src) < len(src):
                                await hf.prefill_and_store(c, model, src)
                            parts.append(
                                KVPart(src, 0 if j == 0 else len(prefix), len(prefix) + len(d), cache_salt="")
                            )
                        exact = len(prefix) + len(docs[0])
                    salt = f"{proto}{i}"
                    res = await c.compose(target, parts, rope=rope, cache_salt=salt)
                    plain = await c.retrieve(target, salt)
                    assert plain is not None, (proto, res)
                    total = plain.shape[2]
                    spans, off = [], len(prefix)
                    for d in docs:
                        a, b = max(off, exact), min(off + len(d), total)
                        if b > a:
                            spans.append((a, b))
                        off += len(d)
                    for v in variants:
                        name, _, f = v.partition("@")
                        kv = plain.clone()
                        t0 = time.perf_counter()
                        if name == "first_k":
                            chosen = await hf.run_model(first_k, model, target, kv, spans, int(f or 16))
                        else:
                            chosen = await hf.run_model(
                                qs.repair, name, model, target, kv, spans, exact, float(f or 0)
                            )
                        key = f"{proto}:{v}"
                        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
                        out = await hf.run_model(
                            hf.generate, model, target, max_new_tokens=16, prefix_kv=kv, eos_token_id=eos
                        )
                        text = tok.decode(out.tokens)
                        rows.setdefault(key, []).append(
                            (
                                s.answer.lower() in text.lower(),
                                out.tokens == full.tokens,
                                qs._kl(full.logits, out.logits),
                                len(chosen) / ndoc,
                            )
                        )
                print(f"  set {i + 1}/{sets}", file=sys.stderr, flush=True)
    return qs.summarise(rows, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", type=int, default=16)
    parser.add_argument("--variants", default="plain,first_k@16,base@0.05,base@0.15,base@0.30")
    parser.add_argument("--protocols", default="alone,prefix")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    table = asyncio.run(run(args.sets, args.variants.split(","), args.protocols.split(",")))
    for v, m in table.items():
        print(
            f"{v:<28} acc {m['accuracy']:.2f}  agree {m['greedy_agreement']:.2f}  "
            f"KL {m['kl_mean']:.4f}  share {m['share']:.3f}  repair {m['repair_s']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
