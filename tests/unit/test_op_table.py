"""The client's one operation table (``_wire.Op``) against the embedded server's own
(``testing.dialect``): two tables written apart, so that one bug cannot pass both sides
(the server is an independent oracle), and this test proves they agree."""

from __future__ import annotations

import pytest

from lmcache_async._protocol import wire as wire
from lmcache_async._protocol.wire import GENERATIONS, Op
from lmcache_async.testing.dialect import ARGUMENTS, GENERATIONS as SERVER_GENERATIONS, LEGACY_OPERATION_IDS

#: The operations the client knows that the embedded server does not serve: the CUDA-IPC
#: registration (GPU-driven transfers; this client registers engine-driven contexts), and
#: the KV-event stream (string-only and streaming; only the real servers publish events).
NOT_SERVED = {Op.REGISTER_KV_CACHE, Op.UNREGISTER_KV_CACHE, Op.SUBSCRIBE_KV_EVENTS}


def test_each_id_is_the_servers_legacy_id_and_a_string_only_op_has_none() -> None:
    for op in Op:
        if op < 0:
            assert op.wire == op.wire_name and op.wire_name not in LEGACY_OPERATION_IDS
        else:
            assert (op.wire, LEGACY_OPERATION_IDS[op.wire_name]) == (int(op), int(op))
    assert len({op.wire_name for op in Op}) == len(Op)


@pytest.mark.parametrize("generation", SERVER_GENERATIONS)
def test_each_arity_is_the_servers_on_both_generations(generation: str) -> None:
    served = ARGUMENTS[generation]  # type: ignore[index]
    ours = GENERATIONS[generation]
    assert {op.wire_name for op in Op} - set(served) == {op.wire_name for op in NOT_SERVED}
    assert set(served) <= {op.wire_name for op in Op}
    for name, declared in served.items():
        op = Op.from_wire(name)
        assert ours.arity(op) == len(declared), name
        assert op.arity + len(ours.trailing_args.get(op, ())) == len(declared), name


def test_phases_and_lookups() -> None:
    assert {op.name: op.phase for op in Op if op.phase != op.wire_name} == {
        "QUERY_PREFETCH_STATUS": "prefetch wait",
        "WAIT_PREFETCH_STATUS": "prefetch wait",
        "PREPARE_STORE": "prepare",
        "PREPARE_RETRIEVE": "prepare",
        "COMMIT_STORE": "commit",
        "COMMIT_RETRIEVE": "commit",
    }
    assert Op.from_wire(8) is Op.from_wire("lookup") is Op.LOOKUP
    assert int(Op.LOOKUP) == 8
    assert wire.op_name(Op.NOOP) == wire.op_name(24) == wire.op_name("noop") == "noop"
    assert wire.op_name(11) == "op#11"  # retired
    for bad in (11, "no_such_op", True, 2.0):
        with pytest.raises(ValueError, match=r"^no operation has the id or name "):
            Op.from_wire(bad)  # type: ignore[arg-type]
