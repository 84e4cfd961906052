"""Composed prompts on a trained model: do they keep their answers, and how fast is the first token?

    .venv/bin/python -m benchmarks.suite.bench_quality [--sets 50] [--new-tokens 32]
        [--contexts 1024 2048 4096] [--reps 2] [--json | --out benchmarks/results/0.1.0/quality.json]

(``make bench`` runs it as the ``quality`` section.) Model: SmolLM2-135M-Instruct in float32
(``lmcache_async.testing.trained``), on the CPU, its KV served by an embedded server (chunk
16, SHM transfer): what is measured is the model's answers and compute, not the server.

Quality. The corpus of :mod:`benchmarks.suite.quality_corpus` (``--sets`` question/document
sets, 2-4 documents each, facts at depths 0, 2 or 4 of 5 sentences). Each document is
cached on its own (never with another document) under two protocols:

* ``alone``: each document and the system prompt cached alone, at positions 0..;
* ``prefix``: each document cached behind the system prompt it is served with (``system +
  document``, :func:`hf_blend.cache_document` with ``prefix``), as a RAG deployment with a
  fixed system prompt can (APE's shared prefix); the first document's part then covers the
  system prompt too and is the full prefill's KV. Fewer methods run under it.

Then the prompt ``system + documents + question`` (chat template), the documents in an
order never cached, is served from LMCache after one of:

* ``full``: the full prefill of the prompt (the reference; no cache);
* ``plain``: :meth:`AsyncClient.compose` (documents' keys rotated to their new positions);
* ``first_k``: :func:`hf.compose_and_repair` with ``recompute=16`` (each document's first
  16 tokens recomputed; EPIC's idea);
* ``blend_<f>``: :func:`hf_blend.compose_and_blend` with ``recompute_fraction`` f in 0,
  0.05, 0.10, 0.15, 0.30, and 0.50 and 1.0 for reference (CacheBlend's selection,
  ``"deviation"`` at layer 1; 1.0 is the full prefill's KV to float rounding);
* ``query_<f>``: the same with ``selection="query"`` (the tokens the question attends to
  most at layer 7), f in 0.05, 0.10, 0.15, 0.30;
* the noise floor (no cache): the full prefill's own KV of the stored chunks rounded to
  bfloat16 (``floor_bf16``), or with Gaussian noise of 0.3 % or 1 % of its standard
  deviation added (``floor_noise0.003``, ``floor_noise0.01``): how far the KV may move
  before greedy answers change on this model.

Per method and protocol: accuracy (the answer appears in the greedy answer: up to
``--new-tokens`` tokens, stopping at ``<|im_end|>``; 32 by default, as the composed prompts'
answers often restate the question before the fact and 16 cut them short), the token F1 of
the answer against the full prefill's (:func:`token_f1`, CacheBlend's scorer), greedy
agreement with the full prefill (all tokens equal; a reported figure, not a target: the
noise floor shows how little moves it on this model), first-token agreement, the next-token
KL(full || method), and the share of the documents' tokens recomputed.

Time to first token (TTFT) at ``--contexts`` tokens: documents of the corpus are cached
alone and composed into a prompt of about that many tokens; the full prefill's TTFT is its
forward pass; a composed method's is the composition call (retrieves, model work, store)
plus the serve's retrieve and the question's prefill. Median of ``--reps``, alternating.

The verdict (issue 32's targets, less greedy agreement): the repair at <= 15 % recomputed, of either selection and
protocol, closest to the targets on the quality corpus is measured again, with the full
prefill, on as many held-out sets (``corpus(seed=HELDOUT_SEED)``, never looked at to choose
anything); its accuracy there is the verdict's (its token F1 and greedy agreement are
reported beside), and its time to first token is timed with the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import string
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.suite.quality_corpus import QASet, corpus
from lmcache_async import AsyncClient, KVPart, RopeSpec, hf, hf_blend
from lmcache_async.testing import EmbeddedServer, trained

CS = 16
SYSTEM = "Answer the question using the documents. Reply with the answer only."
FIRST_K = 16
FRACTIONS = (0.0, 0.05, 0.10, 0.15, 0.30, 0.50, 1.0)
QUERY_FRACTIONS = (0.05, 0.10, 0.15, 0.30)
#: The noise floor: the full prefill's own KV rounded to bfloat16, or with Gaussian noise
#: of this share of the KV's standard deviation added (a fixed seed).
FLOORS = ("floor_bf16", "floor_noise0.003", "floor_noise0.01")
#: Where each document's KV is computed: alone at position 0, or behind the system prompt.
PROTOCOLS = ("alone", "prefix")
#: The methods of each protocol (the floors need no cache: under ``alone`` only).
METHODS = {
    "alone": (
        "full",
        "plain",
        "first_k",
        *(f"blend_{f:.2f}" for f in FRACTIONS),
        *(f"query_{f:.2f}" for f in QUERY_FRACTIONS),
        *FLOORS,
    ),
    "prefix": ("full", "plain", "first_k", "blend_0.15", "query_0.15", "blend_1.00"),
}
#: The composed methods timed (``prefix:`` names the prefix protocol).
TTFT_METHODS = [
    "plain",
    "first_k",
    "blend_0.05",
    "blend_0.15",
    "query_0.10",
    "query_0.15",
    "prefix:plain",
    "prefix:query_0.15",
]
#: The targets of issue 32, at <= 15 % recomputed (greedy agreement is reported, not a target).
TARGETS = {"accuracy_points_below_full": 2.0, "ttft_ratio_2k": 0.4}
#: The corpus seed of the held-out sets the verdict's repair is measured on again.
HELDOUT_SEED = 1

#: Published figures beside ours (what differs: model, data, hardware; see the guide).
PUBLISHED = [
    {
        "work": "CacheBlend (Yao et al., EuroSys 2025)",
        "setting": "Mistral-7B, Yi-34B, Llama-70B; 2WikiMQA, MuSiQue, SAMSum, MultiNews; GPU",
        "figure": "default 15 % of tokens recomputed (chosen by KV deviation); TTFT 2.2-3.3x lower "
        "and throughput 2.8-5x higher than full KV recompute, without compromising generation "
        "quality (abstract)",
    },
    {
        "work": "EPIC (Hu et al., ICML 2025)",
        "setting": "Mistral-7B, Llama-3.1-8B, Yi-9B; LongBench-style RAG tasks; GPU",
        "figure": "LegoLink: recompute the first few (<= 32) tokens of each chunk; up to 8x TTFT "
        "and 7x throughput over existing systems, negligible or no accuracy loss (abstract)",
    },
]


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _normalized_words(text: str) -> list[str]:
    """SQuAD's normalisation: lowercase, no punctuation, no articles, split on whitespace."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def token_f1(prediction: str, reference: str) -> float:
    """The token-overlap F1 of ``prediction`` against ``reference`` (SQuAD's and CacheBlend's
    scorer): both normalised (lowercase, punctuation and the articles a/an/the dropped,
    whitespace collapsed), then the harmonic mean of the precision and recall of their shared
    words, counted with multiplicity.

    Returns:
        A value in [0, 1]: 1.0 when both are empty after normalisation, 0.0 when only one is
        or they share no word.
    """
    pred, ref = _normalized_words(prediction), _normalized_words(reference)
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def _tokens(text: str) -> list[int]:
    return [int(t) for t in trained.smollm2_tokenizer()(text, add_special_tokens=False)["input_ids"]]


def _padded(tokens: list[int]) -> list[int]:
    """A cacheable source: the text padded with newlines to whole chunks."""
    nl = _tokens("\n")[-1]
    return tokens + [nl] * (-len(tokens) % CS)


PREFIX = "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\n"


def _question(q: str) -> list[int]:
    return _tokens(f"Question: {q}<|im_end|>\n<|im_start|>assistant\n")


async def _cache_alone(client: AsyncClient, model: Any, pieces: list[list[int]]) -> list[KVPart]:
    """Each piece cached alone (padded to whole chunks); its part in a composition."""
    nl = _tokens("\n")[-1]
    return [await hf_blend.cache_document(client, model, toks, pad_token_id=nl) for toks in pieces]


async def _cache_parts(
    client: AsyncClient, model: Any, protocol: str, prefix: list[int], docs: list[list[int]]
) -> list[KVPart]:
    """The parts of ``prefix + docs`` under ``protocol`` (``alone`` or ``prefix``)."""
    if protocol == "alone":
        return await _cache_alone(client, model, [prefix, *docs])
    nl = _tokens("\n")[-1]
    parts = [await hf_blend.cache_document(client, model, d, prefix=prefix, pad_token_id=nl) for d in docs]
    first = parts[0]  # system + first document: the full prefill's KV at its own positions
    return [KVPart(first.source_tokens, 0, first.end, cache_salt=""), *parts[1:]]


def _method(
    client: AsyncClient, model: Any, name: str
) -> Callable[[list[int], list[KVPart], str], Awaitable[int]]:
    """The composition of ``name``: returns the tokens it recomputed."""
    rope = RopeSpec.from_hf_config(model.config)

    async def run(target: list[int], parts: list[KVPart], salt: str) -> int:
        if name == "plain":
            await client.compose(target, parts, rope=rope, cache_salt=salt)
            return 0
        if name == "first_k":
            out = await hf.compose_and_repair(
                client, model, target, parts, recompute=FIRST_K, cache_salt=salt
            )
        else:
            selection, _, f = name.partition("_")
            out = await hf_blend.compose_and_blend(
                client,
                model,
                target,
                parts,
                recompute_fraction=float(f),
                selection="query" if selection == "query" else "deviation",
                cache_salt=salt,
            )
        return out.recomputed_tokens

    return run


def _floor(model: Any, name: str, target: list[int], stored: int, new_tokens: int, eos: int) -> hf.Generation:
    """The target served from its full prefill's own KV of ``target[:stored]``, rounded to
    bfloat16 (``floor_bf16``) or with noise (``floor_noise<share>``)."""
    kv = hf.prefill(model, target[:stored]).kv
    if name == "floor_bf16":
        kv = kv.to(torch.bfloat16).to(kv.dtype)
    else:
        share = float(name.removeprefix("floor_noise"))
        noise = torch.randn(kv.shape, generator=torch.Generator().manual_seed(0), dtype=kv.dtype)
        kv = kv + noise * (share * float(kv.std()))
    return hf.generate(model, target, max_new_tokens=new_tokens, prefix_kv=kv, eos_token_id=eos)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


async def quality(
    client: AsyncClient,
    model: Any,
    sets: list[QASet],
    new_tokens: int,
    methods: dict[str, tuple[str, ...]] = METHODS,
    tag: str = "q",
) -> dict[str, Any]:
    """Each of ``methods`` (per protocol; ``full`` among those of the first) on ``sets``."""
    tok = trained.smollm2_tokenizer()
    prefix = _tokens(PREFIX)
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {p: {m: [] for m in ms} for p, ms in methods.items()}
    examples = []
    for i, s in enumerate(sets):
        docs = [_tokens(d) for d in s.documents]
        target = [t for p in (prefix, *docs) for t in p] + _question(s.question)
        doc_tokens = sum(len(d) for d in docs)
        eos = tok.eos_token_id
        full = await hf.run_model(hf.generate, model, target, max_new_tokens=new_tokens, eos_token_id=eos)
        full_answer = tok.decode(full.tokens, skip_special_tokens=True)
        stored = (len(prefix) + doc_tokens) // CS * CS  # what a composition stores
        for protocol, name in ((p, m) for p, ms in methods.items() for m in ms):
            if name == "full":
                g, recomputed = full, doc_tokens
            elif name.startswith("floor_"):
                g = await hf.run_model(_floor, model, name, target, stored, new_tokens, eos)
                recomputed = 0
            else:
                parts = await _cache_parts(client, model, protocol, prefix, docs)
                salt = f"{tag}{i}-{protocol}-{name}"
                recomputed = await _method(client, model, name)(target, parts, salt)
                g = await hf.generate_with_cache(
                    client, model, target, salt, max_new_tokens=new_tokens, eos_token_id=eos
                )
            text = tok.decode(g.tokens)
            rows[protocol][name].append(
                {
                    "correct": s.answer.lower() in text.lower(),
                    "f1": token_f1(tok.decode(g.tokens, skip_special_tokens=True), full_answer),
                    "agree": g.tokens == full.tokens,
                    "first_agree": g.tokens[:1] == full.tokens[:1],
                    "kl": 0.0 if name == "full" else _kl(full.logits, g.logits),
                    "recomputed_share": recomputed / doc_tokens,
                    "prompt_tokens": len(target),
                }
            )
            if i < 3:
                examples.append(
                    {"set": i, "protocol": protocol, "method": name, "answer": s.answer, "output": text}
                )
        print(f"  set {i + 1}/{len(sets)}: {len(target)} tokens", file=sys.stderr, flush=True)
    tables = {p: _table(r) for p, r in rows.items()}
    lengths = [x["prompt_tokens"] for x in next(r["full"] for r in rows.values() if "full" in r)]
    by_depth: dict[str, dict[str, dict[str, float]]] = {}
    for protocol, name in ((p, m) for p, ms in methods.items() for m in ms):
        for depth in sorted({s.depth for s in sets}):
            r = rows[protocol][name]
            hits = [x["correct"] for x, s in zip(r, sets, strict=True) if s.depth == depth]
            by_depth.setdefault(protocol, {}).setdefault(name, {})[str(depth)] = round(
                sum(hits) / len(hits), 4
            )
    return {
        "sets": len(sets),
        "documents_per_set": [2, 4],
        "prompt_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
        "new_tokens": new_tokens,
        "first_k": FIRST_K,
        "protocols": list(methods),
        "methods": tables[next(iter(methods))],
        "by_protocol": tables,
        "accuracy_by_depth": by_depth,
        "examples": examples,
    }


def _table(rows: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    table = {}
    for name, r in rows.items():
        n = len(r)
        table[name] = {
            "accuracy": round(sum(x["correct"] for x in r) / n, 4),
            "token_f1": round(statistics.fmean(x["f1"] for x in r), 4),
            "greedy_agreement": round(sum(x["agree"] for x in r) / n, 4),
            "first_token_agreement": round(sum(x["first_agree"] for x in r) / n, 4),
            "kl_mean": round(statistics.fmean(x["kl"] for x in r), 5),
            "kl_median": round(statistics.median(x["kl"] for x in r), 5),
            "recomputed_share": round(statistics.fmean(x["recomputed_share"] for x in r), 4),
        }
    return table


async def ttft(
    client: AsyncClient, model: Any, contexts: list[int], reps: int, methods: list[str]
) -> dict[str, Any]:
    sets = corpus(400, seed=1)
    pool = [_tokens(d) for s in sets for d in s.documents]
    prefix = _tokens(PREFIX)
    out: dict[str, Any] = {}
    for n in contexts:
        docs: list[list[int]] = []
        total = len(prefix)
        it = iter(pool)
        while total < n - 32:
            d = next(it)
            docs.append(d)
            total += len(d)
        parts = {p: await _cache_parts(client, model, p, prefix, docs) for p in PROTOCOLS}
        target = [t for p in (prefix, *docs) for t in p] + _question(sets[0].question)
        times: dict[str, list[float]] = {m: [] for m in ("full", *methods)}
        for rep in range(reps):
            order = ["full", *methods] if rep % 2 == 0 else [*methods[::-1], "full"]
            for name in order:
                if name == "full":
                    g = await hf.run_model(hf.generate, model, target, max_new_tokens=1)
                    times[name].append(g.prefill_ms)
                    continue
                salt = f"t{n}-{rep}-{name}-{time.time_ns()}"
                protocol, _, method = name.rpartition(":")
                t0 = time.perf_counter()
                await _method(client, model, method)(target, parts[protocol or "alone"], salt)
                compose_ms = (time.perf_counter() - t0) * 1000.0
                g = await hf.generate_with_cache(client, model, target, salt, max_new_tokens=1)
                times[name].append(compose_ms + g.retrieve_ms + g.prefill_ms)
            print(f"  ttft {n}: rep {rep + 1}/{reps}", file=sys.stderr, flush=True)
        full_ms = statistics.median(times["full"])
        out[str(n)] = {
            "prompt_tokens": len(target),
            "documents": len(docs),
            "ms": {m: round(statistics.median(v), 1) for m, v in times.items()},
            "ratio_to_full": {m: round(statistics.median(v) / full_ms, 3) for m, v in times.items()},
        }
    return out


def section(*, sets: int, new_tokens: int, contexts: list[int], reps: int) -> dict[str, Any]:
    """The whole section on an embedded server; returns the result dict."""
    return asyncio.run(_section(sets=sets, new_tokens=new_tokens, contexts=contexts, reps=reps))


async def _section(*, sets: int, new_tokens: int, contexts: list[int], reps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = trained.smollm2()
    load_s = time.perf_counter() - t0
    geometry = hf.geometry_from_model(model)
    tokens_needed = 80_000 + 2 * sum(contexts) * (3 + 8 * reps)
    size = geometry.bytes_per_token * tokens_needed
    async with EmbeddedServer(chunk_size=CS, mode="shm", size_bytes=size) as srv:
        async with AsyncClient(
            srv.url, srv.http_url, f"quality-{time.time_ns()}", geometry=geometry, timeout=600
        ) as c:
            await hf.run_model(hf.prefill, model, _tokens(PREFIX) * 4)  # warm-up, not counted
            q = await quality(c, model, corpus(sets), new_tokens)
            protocol, method = pick(q)
            h = await quality(
                c,
                model,
                corpus(sets, seed=HELDOUT_SEED),
                new_tokens,
                {protocol: ("full", method)},
                tag="h",
            )
            timed = f"{'' if protocol == 'alone' else protocol + ':'}{method}"
            t = await ttft(
                c, model, contexts, reps, [*TTFT_METHODS, *([timed] if timed not in TTFT_METHODS else [])]
            )
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)",
        "gguf": trained.GGUF_NAME,
        "model_load_s": round(load_s, 1),
        "chunk_size": CS,
        "quality": q,
        "heldout": {
            "seed": HELDOUT_SEED,
            "sets": sets,
            "protocol": protocol,
            "method": method,
            "methods": h["by_protocol"][protocol],
        },
        "ttft": t,
        "published": PUBLISHED,
        "targets": TARGETS,
    }
    result["verdict"] = verdict(result)
    return result


def _candidates(m: dict[str, Any]) -> list[str]:
    """The repairs at <= 15 % recomputed (either selection; not the plain composition)."""
    return [
        k
        for k in m
        if k.startswith(("blend_", "query_"))
        and float(k.partition("_")[2]) > 0
        and m[k]["recomputed_share"] <= 0.15 + 1e-9
    ]


def pick(q: dict[str, Any]) -> tuple[str, str]:
    """The protocol and repair at <= 15 % the verdict is about: the closest to the full
    prefill's accuracy on the quality corpus, then the highest token F1, then the highest
    greedy agreement (measured again on held-out sets: a pick among several noisy cells
    flatters the corpus it was picked on)."""
    tables = q.get("by_protocol") or {"alone": q["methods"]}

    def rank(pm: tuple[str, str]) -> tuple[float, float, float]:
        m = tables[pm[0]]
        pts = (m["full"]["accuracy"] - m[pm[1]]["accuracy"]) * 100
        return -pts, m[pm[1]].get("token_f1", 0.0), m[pm[1]]["greedy_agreement"]

    return max(((p, k) for p, m in tables.items() for k in _candidates(m)), key=rank)


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Each target of issue 32, met or not, for the repair :func:`pick` chose: accuracy on the
    held-out sets (``result["heldout"]``; on the quality corpus where there are none), time
    to first token at 2k tokens; its token F1 and greedy agreement there are reported, not
    targets."""
    q = result["quality"]
    tables = q.get("by_protocol") or {"alone": q["methods"]}
    h = result.get("heldout")
    protocol, method = (h["protocol"], h["method"]) if h else pick(q)
    dev = tables[protocol]
    m = h["methods"] if h else dev
    acc_pts = round((m["full"]["accuracy"] - m[method]["accuracy"]) * 100, 1)
    key = "" if protocol == "alone" else f"{protocol}:"
    ttft2k = result["ttft"].get("2048", {}).get("ratio_to_full", {}).get(key + method)
    return {
        "protocol": protocol,
        "method": method,
        "heldout_sets": h["sets"] if h else 0,
        "dev_accuracy_points_below_full": round((dev["full"]["accuracy"] - dev[method]["accuracy"]) * 100, 1),
        "dev_greedy_agreement": dev[method]["greedy_agreement"],
        "accuracy_points_below_full": acc_pts,
        "accuracy_met": acc_pts <= TARGETS["accuracy_points_below_full"],
        "token_f1": m[method].get("token_f1"),
        "greedy_agreement": m[method]["greedy_agreement"],
        "ttft_ratio_2k": ttft2k,
        "ttft_met": None if ttft2k is None or math.isnan(ttft2k) else ttft2k <= TARGETS["ttft_ratio_2k"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", type=Path, help="write the suite's result document here")
    args = parser.parse_args(argv)
    if args.sets < 1 or args.new_tokens < 1 or args.reps < 1:
        parser.error("--sets, --new-tokens and --reps must be >= 1")
    from benchmarks.harness import stamp

    t0 = time.monotonic()
    head = stamp("0.5.6", profile="full")
    params = {"sets": args.sets, "new_tokens": args.new_tokens, "contexts": args.contexts, "reps": args.reps}
    result = section(**params)
    if args.out is not None:
        import os

        head["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
        head["seconds"] = round(time.monotonic() - t0, 1)
        doc = {"section": "quality", "stamp": head, "params": params, "result": result}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json or args.out is None:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
