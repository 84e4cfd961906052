"""Which tokens should the selective repair recompute? Variants of its selection on the quality corpus.

    .venv/bin/python -m benchmarks.probes.quality_selection [--sets 20] [--fraction 0.15]
        [--new-tokens 16] [--variants plain,base,L4,ml4+norm,sink1,sink2+ml2]

The trained model (SmolLM2-135M-Instruct, CPU) on the first ``--sets`` sets of the quality
section's corpus (``benchmarks/suite/quality_corpus.py``), composed as there (the system
prompt and each document cached alone, an embedded server, chunk 16). The plain composition
is retrieved once per set; each variant repairs a copy of it in this process and the prompt
is served from that KV (``--new-tokens`` greedy tokens), against the full prefill. The first
50 sets are the quality section's; more (up to 200) extend its corpus from the same seed;
``--seed`` draws other (held-out) sets.
Reached internals of ``lmcache_async.hf``: ``select_and_recompute``, ``_recompute_at``, ``_layer_kv``'s early
stop (``_StopForward``, ``_decoder_layers``), ``_forward``, ``_cache_layers``.

Variants (each at ``--fraction`` of each document's tokens):

* ``plain``: no repair; ``base``: :func:`hf_blend.select_and_recompute` as shipped (layer 1);
  ``query``: the same with ``selection="query"`` as shipped (its default layer);
* ``L<n>``: the same, selecting at layer ``n``;
* ``+``-joined options: ``ml<n>``: the deviation summed over layers 1..n; ``norm``: each
  layer's deviation divided by its mean first; ``konly`` / ``vonly``: keys or values only;
  ``sink<n>``: each document's first ``n`` tokens always chosen (a document cached alone has
  its own attention sink there); ``tail<n>``: the last ``n`` tokens of the last document too;
  ``rounds2``: recompute the first half of the chosen tokens, then all of them; ``rel``: each
  token's deviation divided by its composed KV's squared norm; ``ml29``: the deviation
  summed over every layer (an oracle: the pass runs the whole model);
* ``qattn<l>[-<l>...]``: the tokens the question (the prompt's uncached tail) attends to
  most at layers ``l`` (summed), ``--fraction`` of each part (the probe's first version of
  ``selection="query"``: its softmax runs over the composed tokens only, the shipped one
  over the question's own tokens too, as the model's attention does); ``qglob<l>...``: the same scores, the same total budget spent over
  all parts at once;
* the noise floor (no repair): ``exact`` (the full prefill's own KV of the stored tokens),
  ``bf16`` / ``fp16`` (it rounded), ``noise<s>`` (Gaussian noise of ``s`` times its standard
  deviation added, a fixed seed).

Printed: accuracy, greedy agreement and mean next-token KL per variant, and the repair's
seconds summed over the sets. The conclusion is in the KV-editing guide
(``docs/guides/kv-editing.md``, the trained-model section).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from benchmarks.suite import bench_quality as bq
from benchmarks.suite.quality_corpus import corpus
from lmcache_async import AsyncClient, RopeSpec, hf, hf_blend
from lmcache_async.testing import EmbeddedServer, trained


def _early_kv(
    model: Any, toks: list[int], kv: torch.Tensor, exact: int, total: int, upto: int
) -> torch.Tensor:
    """KV of layers 0..upto of ``toks[exact:total]`` prefilled over ``kv[:, :, :exact]``:
    ``[2, upto + 1, total - exact, D]``."""
    g = hf.geometry_from_model(model)
    cache = hf.kv_to_cache(kv[:, :, :exact], g, config=model.config)

    def stop(*_: Any) -> None:
        raise hf_blend._StopForward

    handle = hf_blend._decoder_layers(model)[upto].register_forward_hook(stop)
    try:
        hf._forward(model, toks[exact:total], cache, exact)
    except hf_blend._StopForward:
        pass
    finally:
        handle.remove()
    n = total - exact
    out = [
        torch.stack(
            [
                k[0, :, exact:total].transpose(0, 1).reshape(n, -1),
                v[0, :, exact:total].transpose(0, 1).reshape(n, -1),
            ]
        )
        for k, v in hf._cache_layers(cache)[: upto + 1]
    ]
    return torch.stack(out, dim=1)


def _question_attention(
    model: Any, toks: list[int], kv: torch.Tensor, total: int, layers: list[int]
) -> torch.Tensor:
    """Attention mass the question (``toks[total:]``) puts on each of the composed tokens
    ``0..total-1`` at ``layers`` (summed over heads, question tokens and layers)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = hf.geometry_from_model(model)
    cache = hf.kv_to_cache(kv, g, config=model.config)
    mods: Any = hf_blend._decoder_layers(model)
    seen: dict[int, torch.Tensor] = {}
    last = max(layers)

    def capture(idx: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            seen[idx] = q[0]  # [H, n, hd]
            if idx == last:
                raise hf_blend._StopForward

        return hook

    handles = [mods[i].self_attn.register_forward_pre_hook(capture(i), with_kwargs=True) for i in layers]
    try:
        hf._forward(model, toks[total:], cache, total)
    except hf_blend._StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    score = torch.zeros(total)
    for i in layers:
        q = seen[i].float()
        heads = q.shape[0]
        k = kv[0, i, :total].float().view(total, -1, q.shape[-1]).transpose(0, 1)  # [KVH, total, hd]
        k = k.repeat_interleave(heads // k.shape[0], dim=0)
        att = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)  # [H, n, total]
        score += att.sum(dim=(0, 1))
    return score


def repair(
    name: str,
    model: Any,
    toks: list[int],
    kv: torch.Tensor,
    spans: list[tuple[int, int]],
    exact: int,
    f: float,
) -> list[int]:
    """Variant ``name`` on ``kv`` in place; the recomputed positions."""
    if name == "plain":
        return []
    total = kv.shape[2]
    if name in ("exact", "bf16", "fp16") or name.startswith("noise"):
        # The noise floor: the full prefill's own KV, exact or rounded / perturbed.
        kv.copy_(hf.prefill(model, toks[:total]).kv)
        if name in ("bf16", "fp16"):
            kv.copy_(kv.to(torch.bfloat16 if name == "bf16" else torch.float16).float())
        elif name.startswith("noise"):
            gen = torch.Generator().manual_seed(0)
            kv.add_(torch.randn(kv.shape, generator=gen) * float(name[5:]) * kv.std())
        return []
    if name.startswith(("qattn", "qglob")):
        # The question's attention at the given layers ("qattn1-4-8") picks the tokens: in
        # each part its share (qattn), or the same budget over all parts at once (qglob).
        layers = [int(x) for x in name[5:].split("-")] if name[5:] else [1]
        dev = _question_attention(model, toks, kv, total, layers)[exact:]
        chosen: list[int] = []
        if name.startswith("qglob"):
            budget = sum(min(b - a, int(f * (b - a) + 0.5)) for a, b in spans)
            inside = torch.cat([torch.arange(a, b) for a, b in spans])
            top = torch.topk(dev[inside - exact], budget).indices
            chosen = [int(inside[i]) for i in top]
        for a, b in spans if name.startswith("qattn") else []:
            c = min(b - a, int(f * (b - a) + 0.5))
            if c:
                chosen += [int(i) + a for i in torch.topk(dev[a - exact : b - exact], c).indices]
        chosen.sort()
        if chosen:
            hf._recompute_at(model, toks, kv, chosen)
        return chosen
    if name == "base":
        return hf_blend.select_and_recompute(model, toks, kv, spans, f, select_layer=1, exact=exact)
    if name == "query":
        return hf_blend.select_and_recompute(model, toks, kv, spans, f, exact=exact, selection="query")
    if name.startswith("L") and name[1:].isdigit():
        return hf_blend.select_and_recompute(
            model, toks, kv, spans, f, select_layer=int(name[1:]), exact=exact
        )
    opts = name.split("+")

    def num(prefix: str, default: int) -> int:
        return next(
            (int(o[len(prefix) :]) for o in opts if o.startswith(prefix) and o[len(prefix) :].isdigit()),
            default,
        )

    upto, sink, tail = num("ml", 1), num("sink", 0), num("tail", 0)
    d = (_early_kv(model, toks, kv, exact, total, upto).float() - kv[:, : upto + 1, exact:total].float()).pow(
        2
    )
    if "konly" in opts:
        d = d[0:1]
    if "vonly" in opts:
        d = d[1:2]
    per_layer = d.sum(dim=3).sum(dim=0)  # [upto + 1, n]
    if "rel" in opts:  # relative to the composed KV's own size
        size = kv[:, : upto + 1, exact:total].float().pow(2).sum(dim=3).sum(dim=0)
        per_layer = per_layer / (size + 1e-9)
    if "norm" in opts:
        per_layer = per_layer / (per_layer.mean(dim=1, keepdim=True) + 1e-9)
    dev = (per_layer[1:] if upto >= 1 else per_layer).sum(dim=0)
    chosen = []
    for a, b in spans:
        c = min(b - a, int(f * (b - a) + 0.5))
        forced = list(range(a, min(a + sink, b)))
        if tail and b == total:
            forced += list(range(max(a, b - tail), b))
        forced = sorted(set(forced))[:c]
        seg = dev[a - exact : b - exact].clone()
        for t in forced:
            seg[t - a] = -1.0
        if c > len(forced):
            forced += [int(i) + a for i in torch.topk(seg, c - len(forced)).indices]
        chosen += forced
    chosen.sort()
    if chosen:
        if "rounds2" in opts:
            hf._recompute_at(model, toks, kv, chosen[: len(chosen) // 2])
        hf._recompute_at(model, toks, kv, chosen)
    return chosen


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p.double(), -1), torch.log_softmax(q.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


async def run(
    sets: int, variants: list[str], fraction: float, new_tokens: int = 16, seed: int = 0
) -> dict[str, dict[str, float]]:
    model = trained.smollm2()
    tok = trained.smollm2_tokenizer()
    eos = tok.eos_token_id
    g = hf.geometry_from_model(model)
    prefix = bq._tokens(bq.PREFIX)
    rows: dict[str, list[tuple[bool, bool, float]]] = {v: [] for v in ("full", *variants)}
    seconds = dict.fromkeys(variants, 0.0)
    async with EmbeddedServer(chunk_size=bq.CS, mode="shm", size_bytes=g.bytes_per_token * 60_000) as srv:
        async with AsyncClient(
            srv.url, srv.http_url, f"selection-{time.time_ns()}", geometry=g, timeout=600
        ) as c:
            rope = RopeSpec.from_hf_config(model.config)
            for i, s in enumerate(corpus(max(50, sets), seed=seed)[:sets]):
                docs = [bq._tokens(d) for d in s.documents]
                parts = await bq._cache_alone(c, model, [prefix, *docs])
                target = [t for p in (prefix, *docs) for t in p] + bq._question(s.question)
                full = await hf.run_model(
                    hf.generate, model, target, max_new_tokens=new_tokens, eos_token_id=eos
                )
                rows["full"].append((s.answer.lower() in tok.decode(full.tokens).lower(), True, 0.0))
                await c.compose(target, parts, rope=rope, cache_salt=f"p{i}")
                plain = await c.retrieve(target, f"p{i}")
                assert plain is not None
                exact, total = len(prefix), plain.shape[2]
                spans, off = [], exact
                for d in docs:
                    if min(off + len(d), total) > off:
                        spans.append((off, min(off + len(d), total)))
                    off += len(d)
                for v in variants:
                    kv = plain.clone()
                    t0 = time.perf_counter()
                    await hf.run_model(repair, v, model, target, kv, spans, exact, fraction)
                    seconds[v] += time.perf_counter() - t0
                    out = await hf.run_model(
                        hf.generate, model, target, max_new_tokens=new_tokens, prefix_kv=kv, eos_token_id=eos
                    )
                    text = tok.decode(out.tokens)
                    rows[v].append(
                        (
                            s.answer.lower() in text.lower(),
                            out.tokens == full.tokens,
                            _kl(full.logits, out.logits),
                        )
                    )
                print(f"  set {i + 1}/{sets}", file=sys.stderr, flush=True)
    return summarise(rows, seconds)


def summarise(rows: Mapping[str, Sequence[tuple[Any, ...]]], seconds: Mapping[str, float]) -> dict[str, Any]:
    """Per variant: accuracy, greedy agreement, mean KL (the rows' first three fields:
    correct, agrees, KL), the mean recomputed share where rows carry a fourth, and the
    repair's seconds."""
    out: dict[str, Any] = {}
    for v, r in rows.items():
        out[v] = {
            "accuracy": sum(x[0] for x in r) / len(r),
            "greedy_agreement": sum(x[1] for x in r) / len(r),
            "kl_mean": statistics.fmean(x[2] for x in r),
        }
        if all(len(x) > 3 for x in r):
            out[v]["share"] = statistics.fmean(x[3] for x in r)
        out[v]["repair_s"] = seconds.get(v, 0.0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", type=int, default=20)
    parser.add_argument("--fraction", type=float, default=0.15)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="the corpus's seed (0: the quality section's)")
    parser.add_argument("--variants", default="plain,base,L4,ml4+norm,sink1,sink2+ml2")
    args = parser.parse_args(argv)
    if not 1 <= args.sets <= 200 or not 0.0 <= args.fraction <= 1.0:
        parser.error("--sets must be in 1..50, --fraction in [0, 1]")
    table = asyncio.run(run(args.sets, args.variants.split(","), args.fraction, args.new_tokens, args.seed))
    for v, m in table.items():
        print(
            f"{v:<24} accuracy {m['accuracy']:.2f}  greedy agreement {m['greedy_agreement']:.2f}  "
            f"KL {m['kl_mean']:.4f}  repair {m['repair_s']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
