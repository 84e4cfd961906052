"""CUDA tensors in and out: stream ordering, bitwise round trips, the pinned
pool, validation, cancellation mid-copy.

GPU tests are marked ``gpu`` and skipped without CUDA. On a GPU machine, from the repo
root (the command the H200 runs use, see docs/benchmarks.md):

    python -m pytest tests/gpu/test_cuda.py -m gpu -q

They run against the embedded server in SHM mode and in inline mode as 0.5.6 (pickle
payload) and 0.5.7 (msgpack tensor envelope), chunk 256, a 2 GiB pool.
The one test without a GPU checks that a CPU-only process never imports the CUDA module.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_async import AsyncClient, Client, KVGeometry
from tests.helpers import fresh_tokens, peek, unique_model

CS = 256
HAVE_CUDA = torch.cuda.is_available()
gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU"),
]
REPO = Path(__file__).resolve().parents[2]


def geometry(dtype: torch.dtype = torch.bfloat16) -> KVGeometry:
    """8 layers x 1024 hidden: a 256-token chunk is 8 MiB in bf16 (16 MiB in fp32)."""
    return KVGeometry(num_layers=8, num_kv_heads=8, head_dim=128, dtype=dtype, block_size=16)


@pytest.fixture(scope="module", params=["shm", "pickle", "pickle-0.5.7"])
def gpu_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """SHM and inline (0.5.6: pickle payload; 0.5.7: msgpack tensor envelope)."""
    if not HAVE_CUDA:
        pytest.skip("needs a CUDA GPU")
    from lmcache_async.testing import EmbeddedServer

    mode, _, generation = request.param.partition("-")
    handle = EmbeddedServer.start_in_thread(
        chunk_size=CS, mode=mode, size_bytes=2 << 30, generation=generation or "0.5.6"
    )
    yield handle
    handle.stop()


def rand_kv(geom: KVGeometry, tokens: int, device: str = "cuda") -> torch.Tensor:
    """Random KV (never zeros: an unwritten output must not pass)."""
    t = torch.randn(geom.kv_shape(tokens), dtype=torch.float32, device=device).to(geom.dtype)
    torch.cuda.synchronize()
    return t


class Busy:
    """Keeps a stream busy: matmuls queued ahead of a write make a missing wait visible."""

    def __init__(self) -> None:
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        #: The caller's side stream, warmed up (cuBLAS handle and workspace): a first
        #: matmul on a fresh stream may synchronise and hide the hazard.
        self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.stream):
            self.queue(3)
        torch.cuda.synchronize()

    def queue(self, n: int = 500) -> None:
        """Enqueue ``n`` 8192^3 matmuls on the current stream (~0.7 s on an H200)."""
        for _ in range(n):
            torch.mm(self.a, self.a, out=self.c)


@pytest.fixture(scope="module")
def busy() -> Busy:
    if not HAVE_CUDA:
        pytest.skip("needs a CUDA GPU")
    return Busy()


def aclient(server: Any, geom: KVGeometry) -> AsyncClient:
    return AsyncClient(server.url, server.http_url, unique_model("cuda"), geometry=geom, timeout=60)


def copy_streams_idle() -> bool | None:
    """Whether the client's copy streams have nothing pending (None: no such module, as
    before the fix, when copies ran on the worker thread's default stream)."""
    try:
        from lmcache_async._engine.cuda import copies as cuda
    except ImportError:
        return None
    st = cuda._state(torch.device("cuda", torch.cuda.current_device()))
    return all(s.query() for s in st.streams)


async def warm_up(c: AsyncClient, geom: KVGeometry, tokens: int) -> None:
    """One store and one retrieve of the same size first, without any side stream: the
    copy paths' first allocations (a cudaMalloc can synchronise the device) must not
    hide a missing wait in the measured call."""
    t = fresh_tokens(tokens)
    kv = rand_kv(geom, tokens)
    assert await c.store(kv, t) is True
    got = await c.retrieve(t, out=torch.empty_like(kv))
    assert got is not None and torch.equal(got, kv)


async def sessions(c: AsyncClient) -> tuple[int, int]:
    st = await c.status(max_age=0)
    return st["active_sessions"], st["active_prefetch_jobs"]


# ------------------------------------------------------------------ ordering (the defect)


@pytest.mark.anyio
@pytest.mark.parametrize("api", ["store", "store_many"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_store_reads_kv_as_the_callers_stream_sees_it(gpu_server: Any, busy: Busy, api: str) -> None:
    """KV written on a side stream and stored at once: the stored bytes are the written ones."""
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        await warm_up(c, geom, 4 * CS)
        tokens = fresh_tokens(4 * CS)
        ref = rand_kv(geom, len(tokens))
        kv = torch.zeros_like(ref)
        torch.cuda.synchronize()
        side = busy.stream
        with torch.cuda.stream(side):
            busy.queue()
            kv.copy_(ref)  # the engine's write, queued behind the matmuls
            if api == "store":
                assert await c.store(kv, tokens) is True
            else:
                res = await c.store_many([(kv, tokens)], return_exceptions=False)
                assert res.summary.failures == 0
        got = await c.retrieve(tokens)
        assert got is not None and got.device.type == "cpu"
        assert torch.equal(got, ref.cpu())


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_retrieve_into_out_is_ordered_after_the_callers_work_and_complete(
    gpu_server: Any, busy: Busy
) -> None:
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        await warm_up(c, geom, 4 * CS)
        tokens = fresh_tokens(4 * CS)
        ref = rand_kv(geom, len(tokens), device="cpu")
        assert await c.store(ref, tokens) is True
        out = rand_kv(geom, len(tokens))
        garbage = rand_kv(geom, len(tokens))
        side = busy.stream
        with torch.cuda.stream(side):
            busy.queue()
            out.copy_(garbage)  # the caller's pending work on out: must land before ours
            got = await c.retrieve(tokens, out=out)
        idle = copy_streams_idle()  # complete when the call returned
        torch.cuda.synchronize()
        assert got is not None and got.data_ptr() == out.data_ptr()
        assert torch.equal(out.cpu(), ref)  # ordered after the caller's write of garbage
        assert idle is True


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
def test_facade_orders_on_the_calling_threads_stream(gpu_server: Any, busy: Busy) -> None:
    """Client hands calls to its loop thread (default stream): the caller's stream is
    captured before the hand-over, for store and for retrieve(out=)."""
    geom = geometry()
    with Client(gpu_server.url, gpu_server.http_url, unique_model("cuda"), geometry=geom, timeout=60) as c:
        warm = fresh_tokens(4 * CS)
        warm_kv = rand_kv(geom, len(warm))
        assert c.store(warm_kv, warm) is True
        assert c.retrieve(warm, out=torch.empty_like(warm_kv)) is not None
        tokens = fresh_tokens(4 * CS)
        ref = rand_kv(geom, len(tokens))
        kv = torch.zeros_like(ref)
        out = rand_kv(geom, len(tokens))
        garbage = rand_kv(geom, len(tokens))
        side = busy.stream
        with torch.cuda.stream(side):
            busy.queue()
            kv.copy_(ref)
            assert c.store(kv, tokens) is True
            busy.queue()
            out.copy_(garbage)
            got = c.retrieve(tokens, out=out)
        idle = copy_streams_idle()
        torch.cuda.synchronize()
        assert got is not None
        assert torch.equal(out, ref)
        assert idle is True
        cpu = c.retrieve(tokens)
        assert cpu is not None and torch.equal(cpu, ref.cpu())


# ------------------------------------------------------------------ round trips


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
async def test_cuda_round_trip_is_bitwise(gpu_server: Any, dtype: torch.dtype) -> None:
    geom = geometry(dtype)
    async with aclient(gpu_server, geom) as c:
        tokens = fresh_tokens(3 * CS + 5)
        kv = rand_kv(geom, len(tokens))
        want = kv[:, :, : 3 * CS].cpu()
        assert await c.store(kv, tokens) is True
        assert await c.store(kv, tokens) is False
        on_gpu = await c.retrieve(tokens, device="cuda")
        assert on_gpu is not None and on_gpu.device == kv.device and on_gpu.dtype == dtype
        assert on_gpu.shape == (2, 8, 3 * CS, 1024)
        assert torch.equal(on_gpu.cpu(), want)
        out = torch.full(geom.kv_shape(4 * CS), 3.0, dtype=dtype, device="cuda")
        got = await c.retrieve(tokens, out=out, device=torch.device("cuda", 0))
        assert got is not None and got.data_ptr() == out.data_ptr()
        assert torch.equal(out[:, :, : 3 * CS].cpu(), want)
        assert bool((out[:, :, 3 * CS :] == 3.0).all())  # nothing written past the hit
        cpu = await c.retrieve(tokens)
        assert cpu is not None and cpu.device.type == "cpu" and torch.equal(cpu, want)
        # A CPU store read back on the GPU.
        t2 = fresh_tokens(2 * CS)
        kv2 = rand_kv(geom, len(t2), device="cpu")
        assert await c.store(kv2, t2) is True
        back = await c.retrieve(t2, device="cuda:0")
        assert back is not None and torch.equal(back.cpu(), kv2)


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_non_contiguous_cuda_kv_and_out(gpu_server: Any) -> None:
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        tokens = fresh_tokens(2 * CS)
        # [2, L, D, T] transposed to [2, L, T, D]: every chunk is strided.
        base = torch.randn(2, 8, 1024, 2 * CS, device="cuda").to(torch.bfloat16)
        kv = base.transpose(2, 3)
        assert not kv.is_contiguous()
        assert await c.store(kv, tokens) is True
        wide = torch.zeros(2, 8, 2 * CS, 2048, dtype=torch.bfloat16, device="cuda")
        out = wide[..., 1024:]  # right shape, not contiguous
        assert not out.is_contiguous()
        got = await c.retrieve(tokens, out=out)
        assert got is not None
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), kv.cpu())
        assert torch.count_nonzero(wide[..., :1024]) == 0


# ------------------------------------------------------------------ validation


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_bad_cuda_arguments_are_refused_before_anything_is_sent(gpu_server: Any) -> None:
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        tokens = fresh_tokens(2 * CS)
        kv = rand_kv(geom, len(tokens))
        sent_before = peek(c).next_request_uid()
        shape = geom.kv_shape(2 * CS)
        n = torch.cuda.device_count()
        # Factories, not coroutines: a case that fails must not leave the others unawaited.
        cases: list[tuple[Callable[[], Awaitable[Any]], type[Exception], str]] = [
            (
                lambda: c.retrieve(tokens, out=torch.empty(shape, dtype=torch.float16, device="cuda")),
                TypeError,
                "out has dtype torch.float16, the geometry says torch.bfloat16",
            ),
            (
                lambda: c.retrieve(
                    tokens, out=torch.empty(geom.kv_shape(CS), dtype=torch.bfloat16, device="cuda")
                ),
                ValueError,
                r"out has shape \[2, 8, 256, 1024\], expected \[2, 8, 512, 1024\]",
            ),
            (
                lambda: c.retrieve(
                    tokens, out=torch.empty(shape, dtype=torch.bfloat16, device="cuda"), device="cpu"
                ),
                ValueError,
                "out is on cuda:0, device= says cpu",
            ),
            (
                lambda: c.retrieve(tokens, out=torch.empty(shape, dtype=torch.bfloat16), device="cuda"),
                ValueError,
                "out is on cpu, device= says cuda:0",
            ),
            (
                lambda: c.retrieve(tokens, device=f"cuda:{n}"),
                ValueError,
                rf"device cuda:{n} does not exist \({n} CUDA devices\)",
            ),
            (
                lambda: c.retrieve(tokens, device="meta"),
                ValueError,
                "device must be the CPU or a CUDA device, got meta",
            ),
            (
                lambda: c.retrieve(tokens, device="nonsense"),
                ValueError,
                "device must be a torch.device or a device",
            ),
            (
                lambda: c.retrieve(tokens, out=torch.empty(shape, dtype=torch.bfloat16, device="meta")),
                ValueError,
                r"out is a meta tensor \(it has no data\)",
            ),
            (
                lambda: c.store(kv.to(torch.float16), tokens),
                TypeError,
                "kv has dtype torch.float16, the geometry says torch.bfloat16",
            ),
            (
                # (a kv covering fewer tokens than given is stored under tokens[:T])
                lambda: c.store(kv[:, :, :, : geom.hidden_dim // 2], tokens),
                ValueError,
                r"kv has shape \[2, 8, 512, 512\], expected \[2, 8, 512, 1024\]",
            ),
            (
                lambda: c.store(torch.empty(shape, dtype=torch.bfloat16, device="meta"), tokens),
                ValueError,
                r"kv is a meta tensor \(it has no data\)",
            ),
        ]
        for make, exc_type, message in cases:
            with pytest.raises(exc_type, match=message):
                await make()
        assert peek(c).next_request_uid() == sent_before + 1  # nothing was sent meanwhile


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_large_gpu_store_and_background_commits_are_bitwise_and_clean(gpu_server: Any) -> None:
    """16 chunks: one store, the retrieves' commits are answered in the background (two
    concurrent retrieves of one prefix stay serialized on the server side); bitwise, and
    no session or pending read is left."""
    if gpu_server.mode != "shm":
        pytest.skip("SHM only")
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        base = await sessions(c)
        tokens = fresh_tokens(16 * CS)
        kv = rand_kv(geom, len(tokens))
        assert await c.store(kv, tokens) is True
        assert await c.store(kv, tokens) is False  # every chunk cached
        outs = [torch.zeros_like(kv) for _ in range(3)]
        got = await asyncio.gather(*(c.retrieve(tokens, out=o) for o in outs))
        for g, o in zip(got, outs, strict=True):
            assert g is not None and torch.equal(o, kv)
        again = await c.retrieve(tokens, device="cuda")
        assert again is not None and torch.equal(again, kv)
        assert await c.drain(timeout=30)
        assert await sessions(c) == base


# ------------------------------------------------------------------ the pinned pool


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_shm_pool_is_pinned_once_and_unregistered_before_unmap(
    gpu_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if gpu_server.mode != "shm":
        pytest.skip("SHM only")
    from lmcache_async._engine.cuda import copies as cuda

    calls: list[tuple[str, int]] = []
    real_reg, real_unreg = cuda._host_register, cuda._host_unregister

    def reg(address: int, nbytes: int) -> int:
        calls.append(("register", address))
        return real_reg(address, nbytes)

    def unreg(address: int) -> int:
        assert peek(c).pool is not None and peek(c).pool_buffer is not None  # still mapped
        calls.append(("unregister", address))
        return real_unreg(address)

    monkeypatch.setattr(cuda, "_host_register", reg)
    monkeypatch.setattr(cuda, "_host_unregister", unreg)
    geom = geometry()
    c = aclient(gpu_server, geom)
    async with c:
        pool = peek(c).pool
        assert pool is not None and cuda.pinned(pool) is None  # nothing before a CUDA copy
        for _ in range(2):
            tokens = fresh_tokens(2 * CS)
            kv = rand_kv(geom, len(tokens))
            assert await c.store(kv, tokens) is True
            got = await c.retrieve(tokens, device="cuda")
            assert got is not None and torch.equal(got, kv)
        assert cuda.pinned(pool) is True
        address, _ = pool.address_range()
        buffer = peek(c).pool_buffer
        assert buffer is not None and buffer[:16].is_pinned()
    assert calls == [("register", address), ("unregister", address)]


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_unpinnable_pool_falls_back_with_a_warning(
    gpu_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if gpu_server.mode != "shm":
        pytest.skip("SHM only")
    from lmcache_async._engine.cuda import copies as cuda

    unregistered: list[int] = []
    monkeypatch.setattr(cuda, "_host_register", lambda address, nbytes: 1)  # cudaErrorInvalidValue

    def unregister(address: int) -> int:
        unregistered.append(address)
        return 0

    monkeypatch.setattr(cuda, "_host_unregister", unregister)
    geom = geometry()
    caplog.set_level(logging.WARNING, logger="lmcache_async._engine.cuda.copies")
    async with aclient(gpu_server, geom) as c:
        tokens = fresh_tokens(2 * CS)
        kv = rand_kv(geom, len(tokens))
        assert await c.store(kv, tokens) is True
        got = await c.retrieve(tokens, device="cuda")
        assert got is not None and torch.equal(got, kv)
        pool = peek(c).pool
        assert pool is not None and cuda.pinned(pool) is False
    warnings = [r.getMessage() for r in caplog.records if r.name == "lmcache_async._engine.cuda.copies"]
    assert len(warnings) == 1
    assert "cannot pin the SHM pool" in warnings[0] and "cudaHostRegister error 1" in warnings[0]
    assert unregistered == []


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_pickle_staging_buffer_is_pinned_and_reused(gpu_server: Any) -> None:
    if gpu_server.mode != "pickle":
        pytest.skip("pickle only")
    from lmcache_async._engine.cuda import copies as cuda

    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        ptrs = set()
        for _ in range(3):
            tokens = fresh_tokens(3 * CS)
            kv = rand_kv(geom, len(tokens))
            assert await c.store(kv, tokens) is True
            got = await c.retrieve(tokens, device="cuda")
            assert got is not None and torch.equal(got, kv)
            st = cuda._state(torch.device("cuda", 0))
            assert st.staging is not None and st.staging.is_pinned()
            ptrs.add(st.staging.data_ptr())
        assert len(ptrs) == 1


# ------------------------------------------------------------------ cancellation mid-copy


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_cancel_in_the_middle_of_a_gpu_store_still_commits_all_chunks(
    gpu_server: Any, busy: Busy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_async._engine.cuda import copies as cuda

    started = asyncio.Event()
    name = "to_host" if gpu_server.mode == "shm" else "encode_inline"
    real = getattr(cuda, name)

    async def spy(*args: Any, **kw: Any) -> Any:
        started.set()
        return await real(*args, **kw)

    monkeypatch.setattr(cuda, name, spy)
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        base = await sessions(c)
        tokens = fresh_tokens(16 * CS)
        ref = rand_kv(geom, len(tokens))
        kv = torch.zeros_like(ref)
        torch.cuda.synchronize()
        side = busy.stream
        with torch.cuda.stream(side):
            busy.queue()  # the copy waits for these: it is cancelled mid-way
            kv.copy_(ref)
            task = asyncio.ensure_future(c.store(kv, tokens))
            await asyncio.sleep(0)  # the store starts (and marks the stream) in here
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await c.drain(timeout=60)
        got = await c.retrieve(tokens)
        assert got is not None and torch.equal(got, ref.cpu())  # every chunk, fresh bytes
        assert await sessions(c) == base


@pytest.mark.anyio
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")
async def test_cancel_in_the_middle_of_a_gpu_retrieve_releases_everything(
    gpu_server: Any, busy: Busy, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_async._engine.cuda import copies as cuda

    started = asyncio.Event()
    real = cuda.to_device

    async def spy(*args: Any, **kw: Any) -> Any:
        started.set()
        return await real(*args, **kw)

    monkeypatch.setattr(cuda, "to_device", spy)
    geom = geometry()
    async with aclient(gpu_server, geom) as c:
        base = await sessions(c)
        tokens = fresh_tokens(16 * CS)
        ref = rand_kv(geom, len(tokens), device="cpu")
        assert await c.store(ref, tokens) is True
        out = torch.zeros(geom.kv_shape(len(tokens)), dtype=geom.dtype, device="cuda")
        side = busy.stream
        with torch.cuda.stream(side):
            busy.queue()
            task = asyncio.ensure_future(c.retrieve(tokens, out=out))
            await asyncio.sleep(0)
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await c.drain(timeout=60)
        assert await sessions(c) == base
        # The read locks are gone: the objects can be overwritten / evicted as usual, and
        # a new retrieve gets the same bytes.
        again = await c.retrieve(tokens, device="cuda")
        assert again is not None and torch.equal(again.cpu(), ref)
        assert await sessions(c) == base


# ------------------------------------------------------------------ without CUDA


def test_cpu_only_use_never_imports_the_cuda_module() -> None:
    code = textwrap.dedent(
        """
        import asyncio, sys, torch
        import lmcache_async as lmc
        from lmcache_async.testing import EmbeddedServer

        async def main():
            geom = lmc.KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
            for mode in ("shm", "pickle"):
                async with EmbeddedServer(chunk_size=16, mode=mode) as srv:
                    async with lmc.AsyncClient(srv.url, srv.http_url, "m", geometry=geom) as c:
                        kv = torch.randn(geom.kv_shape(32)).to(torch.bfloat16)
                        assert await c.store(kv, list(range(32)))
                        got = await c.retrieve(list(range(32)), device="cpu")
                        assert torch.equal(got, kv)
                        res = await c.store_many([(kv, list(range(100, 132)))])
                        assert res.summary.failures == 0
        asyncio.run(main())
        print("cuda module loaded:", "lmcache_async._engine.cuda.copies" in sys.modules)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "cuda module loaded: False"
