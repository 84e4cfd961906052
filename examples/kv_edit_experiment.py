"""The official KV-edit experiment, with a real transformers model instead of vLLM.

A serving engine stores a source prompt's KV in LMCache; lmcache_async retrieves that KV
and stores it under a target prompt of the same length that differs only in its first
few tokens; the engine then serves the target from LMCache and produces the source's
output. Here the engine is a tiny Llama (``lmcache_async.testing.tiny_llama``: 4 layers,
grouped-query attention, RoPE, fixed-seed random weights, nothing downloaded) driven by
``lmcache_async.hf``.

Steps (printed with their latency):

1. the engine runs the source prompt and stores its whole chunks in LMCache; it serves
   the source from LMCache (cached prefix + computed tail) for the reference output;
2. lmcache_async retrieves the source KV (checked bitwise against the model's own cache);
3. the target token ids: same length, the first ``--changed`` tokens different;
4. the source KV is stored under the target (``store(kv, target)``; the target may be
   longer than the whole chunks the KV covers);
5. the engine serves the target from LMCache: hit tokens and chunks, the uncached tail
   computed at the positions after the cached prefix, greedy decoding;
6. the outputs: whether the target's equals the source's, and a control, the target
   served without the cache (its own prompt: expected to differ).

What is compared: the source and the target are served *the same way* (cached prefix
from LMCache + the same tail tokens computed by the model), so with the same KV their
computation is identical, bit for bit, in float32 and bfloat16. A full prefill of the
same prompt computes the prefix in one batch with the tail and can round differently (in
bfloat16 especially); the report shows separately whether the source's full prefill gives
the same tokens, but that is a statement about numerics, not about LMCache.

Beyond equal lengths (``editing`` in the report; ``lmcache_async.RopeSpec``,
``AsyncClient.compose``, ``hf.compose_and_repair``), each served from LMCache and compared
with a full prefill of the same prompt (greedy agreement over the generated tokens, and
the largest difference of the next-token logits):

a. a uniform shift: a prompt cached at position 0 moved behind a cached prefix, its keys
   rotated; its KV is also compared with the prompt prefilled alone at its new positions
   (the exact part: keys to float32 rounding);
b. two documents cached separately, composed behind a cached system prompt, with
   ``recompute`` 0, 4, 16 and 32 (the first tokens of each document recomputed over the
   composed KV in front of them);
c. the unrotated control: (a) and (b, recompute 0) with the keys left where they were.

Run it with ``make experiment`` (both dtypes, on an embedded server), or::

    python examples/kv_edit_experiment.py [--dtype float32|bfloat16|both]
    python examples/kv_edit_experiment.py --url tcp://localhost:5555 --http-url http://localhost:8080

The server must run with ``--supported-transfer-mode auto`` (see README). Exit code 0
only when every run's target output equals its source output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_async import AsyncClient, KVPart, RopeSpec, hf
from lmcache_async.geometry import dtype_from_name
from lmcache_async.testing import EmbeddedServer
from lmcache_async.testing.tiny_llama import WordTokenizer, tiny_llama

PREVIEW = 8  # output tokens shown


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000.0, 2)


async def run_experiment(
    client: AsyncClient,
    model: Any,
    *,
    chunks: int = 3,
    tail: int = 7,
    changed: int = 3,
    new_tokens: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """The six steps on an open client whose geometry is the model's; returns the report."""
    tokenizer = WordTokenizer(model.config.vocab_size)
    cs = client.chunk_size
    n = chunks * cs + tail
    if not 1 <= changed <= chunks * cs:
        raise ValueError(f"changed must be in 1..{chunks * cs} (inside the cached prefix), got {changed}")
    vocab = tokenizer.vocab_size
    gen = torch.Generator().manual_seed(seed)
    source = torch.randint(1, vocab, (n,), generator=gen).tolist()
    target = [1 + (t + i) % (vocab - 1) for i, t in enumerate(source[:changed])] + source[changed:]
    report = await six_steps(
        client, model, source, target, new_tokens=new_tokens, decode=tokenizer.decode, warm_up=source[::-1]
    )
    return {**report, "changed_tokens": changed}


async def six_steps(
    client: AsyncClient,
    model: Any,
    source: list[int],
    target: list[int],
    *,
    new_tokens: int,
    decode: Callable[[list[int]], str],
    warm_up: list[int] | None = None,
    eos_token_id: int | None = None,
    weights: str = "random weights (seed 0)",
) -> dict[str, Any]:
    """The six steps on a source and a target prompt of the same length; the report."""
    if len(source) != len(target):
        raise ValueError(f"the source has {len(source)} tokens, the target {len(target)}: they must be equal")
    cs = client.chunk_size
    n = len(source)

    def _preview(ids: Sequence[int]) -> dict[str, Any]:
        head = list(ids[:PREVIEW])
        return {"ids": head, "text": decode(head), "full_text": decode(list(ids))}

    steps: list[dict[str, Any]] = []
    if warm_up is not None:
        await hf.run_model(hf.prefill, model, warm_up)  # the engine's warm-up, not timed

    # 1. the engine runs the source prompt and stores its KV; it serves the source
    stored = await hf.prefill_and_store(client, model, source)
    steps.append(
        {
            "step": "1 engine: prefill source + store",
            "tokens": stored.stored_tokens,
            "chunks": stored.stored_chunks,
            "ms": round(stored.compute_ms + stored.store_ms, 2),
            "detail": f"prefill {stored.compute_ms:.1f} ms, store {stored.store_ms:.1f} ms",
        }
    )
    src = await hf.generate_with_cache(
        client, model, source, max_new_tokens=new_tokens, eos_token_id=eos_token_id
    )
    steps.append(_serve_step("1 engine: serve source from LMCache", src, cs))

    # 2. lmcache_async retrieves the source KV
    t0 = time.perf_counter()
    kv = await client.retrieve(source)
    ms = _ms(t0)
    hit = 0 if kv is None else kv.shape[2]
    kv_equal = kv is not None and torch.equal(kv, stored.kv[:, :, :hit])
    steps.append(
        {
            "step": "2 retrieve source KV",
            "tokens": hit,
            "chunks": hit // cs,
            "ms": ms,
            "detail": "bitwise equal to the model's cache" if kv_equal else "NOT equal to the model's cache",
        }
    )

    # 3. the target: same length, the first tokens different
    t0 = time.perf_counter()
    before = await client.lookup(target)
    steps.append(
        {
            "step": "3 target ids; lookup target",
            "tokens": before,
            "chunks": before // cs,
            "ms": _ms(t0),
            "detail": f"{sum(a != b for a, b in zip(source, target, strict=True))} of {n} tokens differ",
        }
    )

    # 4. store the source KV under the target prefix
    stored_new = False
    t0 = time.perf_counter()
    if kv is not None:
        stored_new = await client.store(kv, target)
    ms = _ms(t0)
    after = await client.lookup(target)
    steps.append(
        {
            "step": "4 store source KV under target",
            "tokens": after,
            "chunks": after // cs,
            "ms": ms,
            "detail": f"stored_new={stored_new}; the target now hits {after} tokens",
        }
    )

    # 5. the engine serves the target from LMCache
    tgt = await hf.generate_with_cache(
        client, model, target, max_new_tokens=new_tokens, eos_token_id=eos_token_id
    )
    steps.append(_serve_step("5 engine: serve target from LMCache", tgt, cs))

    # 6. outputs, and the control: the target without the cache
    control = await hf.run_model(
        hf.generate, model, target, max_new_tokens=new_tokens, eos_token_id=eos_token_id
    )
    steps.append(_serve_step("6 control: target without cache", control, cs))
    full_source = await hf.run_model(
        hf.generate, model, source, max_new_tokens=new_tokens, eos_token_id=eos_token_id
    )
    match = tgt.tokens == src.tokens
    return {
        "ok": bool(match and kv_equal and tgt.hit_tokens == stored.stored_tokens),
        "model": {
            "weights": weights,
            "architecture": type(model).__name__,
            "layers": model.config.num_hidden_layers,
            "attention_heads": model.config.num_attention_heads,
            "kv_heads": model.config.num_key_value_heads,
            "head_dim": client.geometry.head_dim,
            "dtype": str(client.geometry.dtype).removeprefix("torch."),
        },
        "transfer": client.transfer,
        "chunk_size": cs,
        "prompt_tokens": n,
        "changed_tokens": sum(a != b for a, b in zip(source, target, strict=True)),
        "new_tokens": new_tokens,
        "source_prompt": _preview(source),
        "target_prompt": _preview(target),
        "steps": steps,
        "source_output": _preview(src.tokens),
        "target_output": _preview(tgt.tokens),
        "control_output": _preview(control.tokens),
        "source_full_prefill_output": _preview(full_source.tokens),
        "source_kv_bitwise_equal": kv_equal,
        "target_hit_tokens": tgt.hit_tokens,
        "outputs_match": match,
        "logits_bitwise_equal": bool(torch.equal(tgt.logits, src.logits)),
        "control_differs": control.tokens != src.tokens,
        "control_first_difference": next(
            (i for i, (a, b) in enumerate(zip(control.tokens, src.tokens, strict=True)) if a != b), None
        ),
        "full_prefill_matches_cached_source": full_source.tokens == src.tokens,
    }


#: The trained model's source and target: the same chat prompt, the system line naming
#: another language (one token each, so the prompts have the same length).
SYSTEM = "You are a helpful assistant. Always reply in {}, whatever language the user writes in."
USER = (
    "Describe a busy Saturday morning at the market of a small town in three sentences: the "
    "stalls of bread, cheese, apples and flowers, the smells, and the people who come from the "
    "villages around it."
)
LANGUAGES = ("French", "German")


async def run_trained(client: AsyncClient, model: Any, *, new_tokens: int = 16) -> dict[str, Any]:
    """The six steps with the trained model (``lmcache_async.testing.trained``) on real text:
    the source's system line says to reply in French, the target's in German. Served from
    the cache (the source's KV stored under the target) the target answers in French, as
    the source did; served from its own prompt (the control) it answers in German."""
    from lmcache_async.testing import trained

    tok = trained.smollm2_tokenizer()
    source, target = (trained.chat_tokens(SYSTEM.format(lang), USER) for lang in LANGUAGES)
    report = await six_steps(
        client,
        model,
        source,
        target,
        new_tokens=new_tokens,
        decode=lambda ids: str(tok.decode(ids)),
        warm_up=source,
        eos_token_id=tok.eos_token_id,
        weights=f"trained ({trained.GGUF_NAME}, dequantized to float32)",
    )
    report["languages"] = {"source": LANGUAGES[0], "target": LANGUAGES[1]}
    # on real text the control must answer differently: else it cannot tell LMCache's KV apart
    report["ok"] = bool(report["ok"] and report["control_differs"])
    return report


RECOMPUTE = (0, 4, 16, 32)


def _versus(g: hf.Generation, ref: hf.Generation) -> dict[str, Any]:
    """How a served generation compares with the full prefill's."""
    same = sum(a == b for a, b in zip(g.tokens, ref.tokens, strict=False))
    return {
        "hit_tokens": g.hit_tokens,
        "agreement": round(same / max(len(ref.tokens), 1), 3),
        "first_difference": next(
            (i for i, (a, b) in enumerate(zip(g.tokens, ref.tokens, strict=False)) if a != b), None
        ),
        "logit_max_abs_diff": round(float((g.logits - ref.logits).abs().max()), 5),
    }


async def run_editing(
    client: AsyncClient, model: Any, *, new_tokens: int = 16, seed: int = 0, question: int = 7
) -> dict[str, Any]:
    """Experiments (a), (b) and (c) of the module docstring on an open client whose
    geometry is the model's; returns the ``editing`` section of the report."""
    cs = client.chunk_size
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    rope = RopeSpec.from_hf_config(model.config)
    # all layers without RoPE: the same placement with the keys left unrotated
    unrotated = RopeSpec(rope.head_dim, layers=(None,) * model.config.num_hidden_layers)
    system, prompt, doc1, doc2, tail = draw(cs), draw(2 * cs), draw(2 * cs), draw(2 * cs), draw(question)
    for t in (system, prompt, doc1, doc2):
        await hf.prefill_and_store(client, model, t)

    async def serve(target: list[int], salt: str) -> hf.Generation:
        return await hf.generate_with_cache(client, model, target, salt, max_new_tokens=new_tokens)

    # (a) the prompt moved behind the system prompt
    target_a = system + prompt + tail
    full_a = await hf.run_model(hf.generate, model, target_a, max_new_tokens=new_tokens)
    parts_a = [KVPart(system, cache_salt=""), KVPart(prompt, cache_salt="")]
    shift = {}
    for name, spec in (("rotated", rope), ("unrotated", unrotated)):
        t0 = time.perf_counter()
        res = await client.compose(target_a, parts_a, rope=spec, cache_salt=f"a-{name}")
        ms = _ms(t0)
        shift[name] = {**_versus(await serve(target_a, f"a-{name}"), full_a), "compose_ms": ms}
        shift[name]["stored_tokens"] = res.stored_tokens
    moved = await client.retrieve(target_a[: 3 * cs], "a-rotated")
    fresh, _ = await hf.run_model(_prefill_at, model, prompt, cs)
    assert moved is not None
    keys = moved[0, :, cs:].float() - fresh[0].float()
    shift["key_error_vs_prefill_at_new_positions"] = float(keys.abs().max() / fresh[0].float().abs().max())
    shift["values_first_layer_bitwise"] = bool(torch.equal(moved[1, 0, cs:], fresh[1, 0]))

    # (b) two documents behind the system prompt, repaired with recompute k; (c) unrotated
    target_b = system + doc1 + doc2 + tail
    full_b = await hf.run_model(hf.generate, model, target_b, max_new_tokens=new_tokens, keep_kv=True)
    assert full_b.prompt_kv is not None
    parts_b = [KVPart(system, cache_salt=""), KVPart(doc1, cache_salt=""), KVPart(doc2, cache_salt="")]
    repair = []
    for k in RECOMPUTE:
        t0 = time.perf_counter()
        out = await hf.compose_and_repair(client, model, target_b, parts_b, recompute=k, cache_salt=f"b-{k}")
        row = {"recompute": k, **_versus(await serve(target_b, f"b-{k}"), full_b), "compose_ms": _ms(t0)}
        if out.kv is not None:  # the stored target's KV against the full prefill's
            diff = out.kv.float() - full_b.prompt_kv[:, :, : out.kv.shape[2]].float()
            row["kv_mean_abs_diff"] = round(float(diff.abs().mean()), 6)
        repair.append(row)
    await client.compose(target_b, parts_b, rope=unrotated, cache_salt="b-unrotated")
    control_b = {"recompute": 0, **_versus(await serve(target_b, "b-unrotated"), full_b)}
    return {
        "system_tokens": len(system),
        "prompt_tokens": len(prompt),
        "document_tokens": [len(doc1), len(doc2)],
        "question_tokens": question,
        "shift": shift,
        "compose": repair,
        "compose_unrotated": control_b,
    }


def _prefill_at(model: Any, tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` alone at positions ``start ..``: their KV and last logits."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kwarg = "cache" if "cache" in hf._forward_params(type(model)) else "past_key_values"
    positions = torch.arange(start, start + len(tokens)).unsqueeze(0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([tokens]), position_ids=positions, use_cache=True, **{kwarg: cache}
        )
    return hf.cache_to_kv(cache, hf.geometry_from_model(model)), out.logits[0, -1].float()


def render_editing(e: dict[str, Any]) -> str:
    """The ``editing`` section as text."""
    s = e["shift"]
    lines = [
        f"  Beyond equal lengths: system prompt {e['system_tokens']} tokens, prompt {e['prompt_tokens']}, "
        f"documents {e['document_tokens']}, question {e['question_tokens']}; each served from LMCache, "
        "against a full prefill",
        f"  (a) prompt moved behind the system prompt: moved keys vs the prompt prefilled at its new "
        f"positions: max error {s['key_error_vs_prefill_at_new_positions']:.2e} of the largest key; "
        f"first layer's values bitwise: {'yes' if s['values_first_layer_bitwise'] else 'no'}",
        f"  {'case':<34} {'agreement':>9} {'first diff':>10} {'max |dlogit|':>12} {'KV mean |d|':>11}",
    ]

    def row(name: str, r: dict[str, Any]) -> str:
        kv = r.get("kv_mean_abs_diff")
        return (
            f"  {name:<34} {r['agreement']:>9.3f} {r['first_difference']!s:>10} "
            f"{r['logit_max_abs_diff']:>12.4f} {'' if kv is None else f'{kv:.5f}':>11}"
        )

    lines.append(row("(a) shift, rotated", s["rotated"]))
    lines.append(row("(c) shift, unrotated (control)", s["unrotated"]))
    for r in e["compose"]:
        lines.append(row(f"(b) two documents, recompute {r['recompute']}", r))
    lines.append(row("(c) two documents, unrotated", e["compose_unrotated"]))
    return "\n".join(lines)


def _serve_step(name: str, g: hf.Generation, cs: int) -> dict[str, Any]:
    return {
        "step": name,
        "tokens": g.hit_tokens,
        "chunks": g.hit_tokens // cs,
        "ms": round(g.retrieve_ms + g.prefill_ms + g.decode_ms, 2),
        "detail": (
            f"reused {g.reused_tokens}, computed {g.computed_tokens} at positions "
            f"{g.reused_tokens}..{g.prompt_tokens - 1}; retrieve {g.retrieve_ms:.1f} + prefill "
            f"{g.prefill_ms:.1f} + decode {g.decode_ms:.1f} ms"
        ),
    }


def render(report: dict[str, Any], where: str) -> str:
    """The report as text."""
    m = report["model"]
    yes = {True: "yes", False: "no"}
    lines = [
        f"KV-edit experiment on {where} (transfer {report['transfer']}, chunk size {report['chunk_size']})",
        f"  model: {m['architecture']}, {m['layers']} layers, {m['attention_heads']} attention heads / "
        f"{m['kv_heads']} KV heads x {m['head_dim']}, {m['dtype']}, {m['weights']}",
        f"  prompt: {report['prompt_tokens']} tokens; the target differs from the source in "
        f"{report['changed_tokens']} of them",
        f"  source: {report['source_prompt']['ids']} ... '{report['source_prompt']['text']} ...'",
        f"  target: {report['target_prompt']['ids']} ... '{report['target_prompt']['text']} ...'",
        "",
        f"  {'step':<38} {'hit/stored tokens':>17} {'chunks':>6} {'ms':>9}",
    ]
    for s in report["steps"]:
        lines.append(f"  {s['step']:<38} {s['tokens']:>17} {s['chunks']:>6} {s['ms']:>9.1f}  {s['detail']}")
    lines += [
        "",
        _output_line("source output (from LMCache):", report["source_output"]),
        _output_line("target output (from LMCache):", report["target_output"]),
        _output_line("control (target, no cache):", report["control_output"]),
        _output_line("source, full prefill:", report["source_full_prefill_output"]),
        "",
        f"  target output == source output ({report['new_tokens']} tokens): {yes[report['outputs_match']]}"
        f" (next-token logits bitwise equal: {yes[report['logits_bitwise_equal']]})",
        f"  control differs from the source output: {yes[report['control_differs']]}"
        + (
            f" (from output token {report['control_first_difference']} on)"
            if report["control_differs"]
            else ""
        ),
        f"  source's full prefill gives the same tokens as the cached source: "
        f"{yes[report['full_prefill_matches_cached_source']]} (numerics only; not compared)",
        "OK" if report["ok"] else "FAILED: the target's output is not the source's",
    ]
    return "\n".join(lines)


def _output_line(label: str, preview: dict[str, Any]) -> str:
    return f"  {label:<31} {preview['ids']} {preview['full_text']!r}"


async def _main(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    if args.weights == "trained":
        dtypes = []
    reports: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        if args.url is None:
            server = EmbeddedServer(chunk_size=args.chunk_size, mode=args.mode, size_bytes=64 << 20)
            await stack.enter_async_context(server)
            url, http_url, where = server.url, server.http_url, f"the embedded server ({args.mode})"
        else:
            url, http_url, where = args.url, args.http_url, f"the server at {args.url}"
        for name in dtypes:
            model = tiny_llama(dtype_from_name(name), seed=args.seed)
            geometry = hf.geometry_from_model(model)
            model_name = f"{args.model}-{name}-{time.time_ns()}"  # a fresh cache namespace per run
            async with AsyncClient(
                url, http_url, model_name, geometry=geometry, timeout=args.timeout, transfer=args.transfer
            ) as client:
                report = await run_experiment(
                    client,
                    model,
                    chunks=args.chunks,
                    tail=args.tail,
                    changed=args.changed,
                    new_tokens=args.new_tokens,
                    seed=args.seed,
                )
                if not args.no_editing:
                    report["editing"] = await run_editing(
                        client, model, new_tokens=args.new_tokens, seed=args.seed
                    )
                reports.append(report)
        if args.weights in ("trained", "both"):
            from lmcache_async.testing import trained

            model = trained.smollm2()
            async with AsyncClient(
                url,
                http_url,
                f"{args.model}-trained-{time.time_ns()}",
                geometry=hf.geometry_from_model(model),
                timeout=args.timeout,
                transfer=args.transfer,
            ) as client:
                reports.append(await run_trained(client, model, new_tokens=args.new_tokens))
    return reports, where


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="ZMQ endpoint of a running server (with --http-url)")
    parser.add_argument("--http-url", help="HTTP endpoint of a running server (with --url)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    parser.add_argument("--chunk-size", type=int, default=64, help="embedded server's chunk size (64)")
    parser.add_argument("--mode", choices=("shm", "pickle"), default="shm", help="embedded server's transfer")
    parser.add_argument("--transfer", choices=("auto", "shm", "pickle"), default="auto")
    parser.add_argument("--chunks", type=int, default=3, help="whole chunks in the prompt (3)")
    parser.add_argument("--tail", type=int, default=7, help="prompt tokens after the last whole chunk (7)")
    parser.add_argument("--changed", type=int, default=3, help="leading target tokens that differ (3)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens to generate (16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt (0)")
    parser.add_argument("--model", default="kv-edit-tiny-llama", help="model name prefix in LMCache")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of each operation (s)")
    parser.add_argument(
        "--weights",
        choices=("random", "trained", "both"),
        default="both",
        help="the tiny random-weight Llama (both dtypes), the trained SmolLM2-135M-Instruct on real "
        "text (float32), or both (default)",
    )
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    parser.add_argument("--no-editing", action="store_true", help="skip experiments (a)-(c) (shift, compose)")
    args = parser.parse_args(argv)
    if (args.url is None) != (args.http_url is None):
        parser.error("--url and --http-url go together")
    if args.chunks < 1 or args.tail < 0 or args.new_tokens < 1 or args.chunk_size < 1:
        parser.error("--chunks, --new-tokens and --chunk-size must be >= 1, --tail >= 0")
    if args.changed < 1:
        parser.error("--changed must be >= 1")
    reports, where = asyncio.run(_main(args))
    if args.json:
        print(json.dumps(reports, indent=2))
    else:
        print(
            "\n\n".join(
                render(r, where) + ("\n\n" + render_editing(r["editing"]) if "editing" in r else "")
                for r in reports
            )
        )
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
