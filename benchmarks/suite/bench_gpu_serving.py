"""Serving a prompt from the cache on a GPU, against recomputing it. Needs a GPU.

    python -m benchmarks.suite.bench_gpu_serving [--contexts 2048 8192 16384 32768]
        [--compose-contexts 8192 32768] [--reps 5] [--json out.json] [--plot out.png]

A Llama model of Llama-3.1-8B's shape (32 layers, hidden 4096, 32 heads sharing 8 KV
heads of 128, MLP 14336, vocabulary 128256), random weights built on the GPU from its
config (time does not depend on the weights' values), bf16. The embedded server in its
own process (``lmcache-async serve``, SHM, chunk 256, prefaulted pool); one
``AsyncClient``. Milliseconds to the first token (``max_new_tokens=1``), every timed call
between two ``torch.cuda.synchronize()``; the median of ``--reps`` after one warm-up.

* ``prompts``: per context ``C``, a prompt of ``C + 16`` tokens whose first ``C`` are
  cached (stored from the GPU by :func:`lmcache_async.hf.prefill_and_store`):
  ``full`` (:func:`hf.generate`, the whole prompt computed), ``hf`` (:func:`hf.generate_with_cache`),
  ``raw`` (``retrieve(out=<cuda>)``, then :func:`hf.generate` over it: the tail) and
  ``limit`` (a pinned host-to-device ``copy_`` of the same KV bytes, then the same tail).
* ``compose``: per context and 4 or 8 documents of ``C / n`` tokens, each cached alone at
  position 0, placed in reverse order with a 16-token question after them:
  ``full`` (the target prefilled), ``plain`` (:func:`hf.compose_and_repair`,
  ``recompute=0``), and :func:`hf_blend.compose_and_blend` at 5 % and 15 % with the
  ``deviation`` and ``query`` selections, each serving the first token from the composed
  KV (``max_new_tokens=1``) while the target's store runs (awaited after the timing).
  ``--fractions`` and ``--selections`` narrow them; ``--masked`` times each repair again
  through the 4D-mask pass that the in-place one (``lmcache_async._engine.hf_recompute``)
  replaced on GPUs, in the same run.

The JSON names the card (``torch.cuda.get_device_name``); figures from another card
are not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import lmcache_async as lmc
from benchmarks.probes.bench_cuda import ROOT, start_server
from lmcache_async import KVPart, hf, hf_blend
from lmcache_async._engine import hf_recompute as _hf_recompute

CS = 256
TAIL = 16
LLAMA_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
FRACTIONS = (0.05, 0.15)
SELECTIONS = ("deviation", "query")


def build_model(layers: int | None = None, device: str = "cuda", small: bool = False) -> Any:
    """The 8B-shaped Llama, random weights drawn on the GPU in bf16 (``small``: a
    128-wide model, for a dry run of the script on the CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {**LLAMA_8B, **({"num_hidden_layers": layers} if layers else {})}
    if small:
        sizes.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    config = LlamaConfig(**sizes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Tokens:
    """Fresh random prompts (ids below the vocabulary), never repeated within a run."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def fresh(self, n: int) -> list[int]:
        return torch.randint(0, LLAMA_8B["vocab_size"], (n,), generator=self.gen).tolist()


async def timed(
    fn: Callable[[], Awaitable[Any]], reps: int, after: Callable[[], Awaitable[Any]] | None = None
) -> dict[str, Any]:
    """Median, min and max milliseconds of ``reps`` calls after one warm-up; ``after``
    runs after each call, untimed."""
    times = []
    for i in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        await fn()
        sync()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
        if after is not None:
            await after()
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": reps}


async def prompt_row(
    client: lmc.AsyncClient, model: Any, ctx: int, prompt: list[int], reps: int
) -> dict[str, Any]:
    """One context of ``prompts``: the prompt's first ``ctx`` tokens cached, four ways to
    its first token."""
    geometry = client.geometry
    stored = await hf.prefill_and_store(client, model, prompt[:ctx])
    assert stored.stored_tokens == ctx
    device = hf._model_device(model)
    dev = torch.empty(geometry.kv_shape(len(prompt)), dtype=geometry.dtype, device=device)
    host = torch.empty(geometry.kv_shape(ctx), dtype=geometry.dtype)
    host = host.pin_memory() if device.type == "cuda" else host
    limit_dev = torch.empty(geometry.kv_shape(ctx), dtype=geometry.dtype, device=device)

    async def full() -> None:
        await hf.run_model(hf.generate, model, prompt, max_new_tokens=1)

    async def cached() -> None:
        g = await hf.generate_with_cache(client, model, prompt, max_new_tokens=1)
        assert g.reused_tokens == ctx

    async def raw() -> None:
        kv = await client.retrieve(prompt, out=dev)
        assert kv is not None and kv.shape[2] == ctx
        await hf.run_model(hf.generate, model, prompt, max_new_tokens=1, prefix_kv=kv)

    def copy_and_tail() -> None:
        limit_dev.copy_(host, non_blocking=True)
        hf.generate(model, prompt, max_new_tokens=1, prefix_kv=limit_dev)

    async def limit() -> None:
        await hf.run_model(copy_and_tail)

    row: dict[str, Any] = {"kv_bytes": host.numel() * host.element_size()}
    for name, fn in (("full", full), ("hf", cached), ("raw", raw), ("limit", limit)):
        row[name] = await timed(fn, reps)
    row["hf_over_limit"] = row["hf"]["median_ms"] / row["limit"]["median_ms"]
    row["hf_over_full"] = row["hf"]["median_ms"] / row["full"]["median_ms"]
    return row


async def prompts(client: lmc.AsyncClient, model: Any, contexts: list[int], reps: int) -> dict[str, Any]:
    tokens = Tokens(1)
    out: dict[str, Any] = {}
    for ctx in contexts:
        row = out[str(ctx)] = await prompt_row(client, model, ctx, tokens.fresh(ctx + TAIL), reps)
        print(
            f"prompt {ctx}: "
            + ", ".join(f"{k} {v['median_ms']:.1f}" for k, v in row.items() if isinstance(v, dict))
        )
        empty_cache()
    return out


@dataclass(frozen=True)
class Cases:
    """The repairs a composition row times: each fraction with each selection; with
    ``masked``, each of them again through the 4D-mask pass the in-place one replaced
    (the same run's A/B)."""

    fractions: tuple[float, ...] = FRACTIONS
    selections: tuple[str, ...] = SELECTIONS
    masked: bool = False

    def names(self) -> list[tuple[str, float, str, bool]]:
        out = [("plain", 0.0, "", False)]
        for f in self.fractions:
            for sel in self.selections:
                out.append((f"{sel}_{round(f * 100)}", f, sel, False))
                if self.masked:
                    out.append((f"{sel}_{round(f * 100)}_masked", f, sel, True))
        return out


@contextlib.contextmanager
def masked_pass(on: bool) -> Iterator[None]:
    """The repairs' passes through transformers' attention with a 4D mask (the path
    before the in-place pass), while ``on``."""
    saved = _hf_recompute.DEVICES
    if on:
        _hf_recompute.DEVICES = ()
    try:
        yield
    finally:
        _hf_recompute.DEVICES = saved


async def compose_row(
    client: lmc.AsyncClient,
    model: Any,
    docs: list[list[int]],
    question: list[int],
    salt: str,
    reps: int,
    cases: Cases,
) -> dict[str, Any]:
    """One composition: the documents (cached alone) in reverse order, the question after
    them; the full prefill, plain composition and the selective repairs."""
    for d in docs:
        await hf.prefill_and_store(client, model, d)
    order = docs[::-1]
    target = [t for d in order for t in d] + question
    parts = [KVPart(d, cache_salt="") for d in order]
    pending: list[asyncio.Future[bool]] = []

    async def full() -> None:
        await hf.run_model(hf.generate, model, target, max_new_tokens=1)

    async def served(fraction: float, selection: str) -> None:
        if fraction == 0:
            res = await hf.compose_and_repair(client, model, target, parts, cache_salt=salt, max_new_tokens=1)
        else:
            res = await hf_blend.compose_and_blend(
                client, model, target, parts, recompute_fraction=fraction,
                selection=selection, cache_salt=salt, max_new_tokens=1,
            )  # fmt: skip
        assert res.generation is not None and res.stored is not None
        pending.append(res.stored)  # the store runs past the first token: awaited untimed

    row: dict[str, Any] = {"target_tokens": len(target), "full": await timed(full, reps)}

    async def stored() -> None:
        await asyncio.gather(*pending)
        pending.clear()

    for name, fraction, selection, masked in cases.names():
        with masked_pass(masked):
            row[name] = await timed(functools.partial(served, fraction, selection), reps, stored)
        row[name]["over_full"] = row[name]["median_ms"] / row["full"]["median_ms"]
        print(f"  {name}: {row[name]['median_ms']:.1f} ms, {row[name]['over_full']:.3f}x full", flush=True)
    return row


async def compose(
    client: lmc.AsyncClient, model: Any, contexts: list[int], docs_counts: list[int], reps: int, cases: Cases
) -> dict[str, Any]:
    tokens = Tokens(2)
    out: dict[str, Any] = {}
    for ctx in contexts:
        for n in docs_counts:
            docs = [tokens.fresh(ctx // n) for _ in range(n)]
            question = tokens.fresh(TAIL)
            row = await compose_row(client, model, docs, question, f"target-{ctx}-{n}", reps, cases)
            out[f"{ctx}x{n}"] = {"context": ctx, "documents": n, **row}
            print(
                f"compose {ctx}x{n}: "
                + ", ".join(f"{k} {v['median_ms']:.1f}" for k, v in row.items() if isinstance(v, dict))
            )
            empty_cache()
    return out


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stamp() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (dry run)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "lmcache_async": lmc.__version__,
        "commit": commit or "unknown",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "script": "benchmarks/suite/bench_gpu_serving.py",
        "model": "Llama-3.1-8B shape, random weights, bf16, sdpa",
        "server": "embedded (lmcache-async serve), SHM, chunk 256",
        "tail_tokens": TAIL,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args.layers, args.device, small=args.device == "cpu")
    geometry = hf.geometry_from_model(model)
    proc, info = start_server("shm", args.size)  # chunk 256, prefaulted
    try:
        async with lmc.AsyncClient(
            info["url"], info["http_url"], "bench-gpu", geometry=geometry, timeout=300
        ) as c:
            result: dict[str, Any] = {**stamp(), "reps": args.reps}
            if args.contexts:
                result["prompts"] = await prompts(c, model, args.contexts, args.reps)
            if args.compose_contexts:
                cases = Cases(tuple(args.fractions), tuple(args.selections), args.masked)
                result["compose"] = await compose(
                    c, model, args.compose_contexts, args.documents, args.reps, cases
                )
            return result
    finally:
        proc.terminate()
        proc.wait(30)


def plot(data: dict[str, Any], path: Path) -> None:
    """Two panels: prompts (ms to the first token per context) and compositions (x full)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    pr = data.get("prompts", {})
    ctxs = sorted(pr, key=int)
    for key, label in (
        ("full", "full prefill"),
        ("hf", "hf.generate_with_cache"),
        ("limit", "limit (pinned copy + tail)"),
    ):
        axes[0].plot([int(c) for c in ctxs], [pr[c][key]["median_ms"] for c in ctxs], marker="o", label=label)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("cached context (tokens)")
    axes[0].set_ylabel("ms to the first token")
    axes[0].set_title(f"A cached prompt ({data.get('card', '?')})")
    axes[0].legend()
    co = data.get("compose", {})
    cases = [
        k for k in next(iter(co.values()), {}) if isinstance(next(iter(co.values()))[k], dict) and k != "full"
    ]
    keys = list(co)
    width = 0.8 / max(1, len(cases))
    for i, case in enumerate(cases):
        axes[1].bar(
            [j + i * width for j in range(len(keys))],
            [co[k][case]["over_full"] for k in keys],
            width,
            label=case,
        )
    axes[1].axhline(1.0, color="black", linewidth=0.8)
    axes[1].set_xticks(
        [j + 0.4 - width / 2 for j in range(len(keys))],
        [f"{co[k]['context'] // 1024}k, {co[k]['documents']} docs" for k in keys],
    )
    axes[1].set_ylabel("time to first token / full prefill's")
    axes[1].set_title("Composed documents")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="*", default=[2048, 8192, 16384, 32768])
    parser.add_argument("--compose-contexts", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--documents", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--selections", nargs="+", choices=SELECTIONS, default=list(SELECTIONS))
    parser.add_argument(
        "--masked", action="store_true", help="also each repair through the 4D-mask pass (A/B)"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--size", default="40G", help="the server's SHM pool")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a smoke run)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run of the script
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    for c in args.contexts:
        if c % CS:
            parser.error(f"context {c} must be whole {CS}-token chunks")
    for c in args.compose_contexts:
        if any(c % n or (c // n) % CS for n in args.documents):
            parser.error(f"context {c} must split into whole {CS}-token chunks per document")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
