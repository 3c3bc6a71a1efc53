"""Plan validation (pure: no processes): every invalid plan is rejected with a message naming the operation."""

import threading
import time

import pytest
import torch

import hpdl.offload as ho
from hpdl.offload import plans
from hpdl.offload.compiler import check_plan, compile_group
from hpdl.offload.executor import Executor


def pair(build0, build1, name="p"):
    """Data of a two-rank plan, built by two functions of (plan, buffer)."""
    out = []
    for r, build in enumerate((build0, build1)):
        p = ho.Plan(name, rank=r, world_size=2)
        x = p.buffer("x", (4, 8), torch.float32)
        build(p, x)
        out.append(p.data())
    return out


def raises(match, fn, *a, **kw):
    with pytest.raises(ho.PlanError, match=match) as info:
        fn(*a, **kw)
    return info.value


def test_out_of_range_box_names_op_buffer_and_dim():
    p = ho.Plan("oob", world_size=2)
    x = p.buffer("x", (4, 8), torch.float32)
    p.send(x[0, 2:12], peer=1, name="to_right")
    e = raises(r"op 'to_right' \(send to rank 1\): src x\[0:1, 2:12\] is out of range for buffer 'x' of shape "
               r"\(4, 8\): dim 1 needs 0 <= 2 <= 12 <= 8", check_plan, p.data())
    assert e.op == "to_right"
    p = ho.Plan("neg", world_size=2)
    y = p.buffer("y", 5, torch.int64)
    p.copy(y[-9:-7], y[0:2], name="c")  # -9 + 5 = -4: still out of range after Python's wrap
    raises(r"op 'c' \(copy\): dst y\[-4:-2\] is out of range", check_plan, p.data())


def test_region_indexing_rules():
    p = ho.Plan("r")
    x = p.buffer("x", (3, 4, 5), "float64")
    assert x[1].box == ((1, 2), (0, 4), (0, 5))
    assert x[..., -1].box == ((0, 3), (0, 4), (4, 5))
    assert str(x[:, 1:3]) == "x[0:3, 1:3, 0:5]"
    with pytest.raises(ho.PlanError, match="slice step 2 is not supported"):
        x[::2]
    with pytest.raises(ho.PlanError, match="has 3 dimensions"):
        x[0, 0, 0, 0]
    with pytest.raises(ho.PlanError, match="registered twice"):
        p.buffer("x", 3, torch.float32)
    with pytest.raises(ho.PlanError, match="dtype must be a torch dtype"):
        p.buffer("z", 3, "float33")
    with pytest.raises(ho.PlanError, match="shape must be non-negative ints"):
        p.buffer("w", (3, -1), torch.float32)
    with pytest.raises(ho.PlanError, match="op name 'a' is used twice"):
        p.copy(x[0], x[1], name="a")
        p.copy(x[1], x[2], name="a")


def test_cycle_through_forward_names():
    p = ho.Plan("cyc")
    x = p.buffer("x", (4,), torch.float32)
    p.copy(x[0:1], x[1:2], after=["c"], name="a")
    p.copy(x[2:3], x[0:1], after=["a"], name="b")
    p.copy(x[3:4], x[2:3], after=["b"], name="c")
    e = raises(r"op 'a' \(copy\) is on a dependency cycle \('a' -> 'c' -> 'b' -> 'a': each waits for the next\)",
               check_plan, p.data())
    assert e.op == "a"


def test_bad_dependencies():
    p = ho.Plan("deps")
    x = p.buffer("x", (4,), torch.float32)
    p.copy(x[0:1], x[1:2], after=["nope"], name="a")
    raises(r"op 'a' \(copy\): after= names 'nope', which is not an op of plan 'deps'", check_plan, p.data())
    p = ho.Plan("self")
    x = p.buffer("x", (4,), torch.float32)
    p.copy(x[0:1], x[1:2], after=["a"], name="a")
    raises(r"op 'a' \(copy\): depends on itself", check_plan, p.data())
    other = ho.Plan("other")
    y = other.buffer("y", 2, torch.float32)
    ref = other.copy(y[0:1], y[1:2])
    with pytest.raises(ho.PlanError, match="after= names 'copy0' of plan 'other'"):
        p.copy(x[2:3], x[3:4], after=[ref])


def test_local_copy_and_reduce_checks():
    p = ho.Plan("loc")
    x = p.buffer("x", (8,), torch.float32)
    i = p.buffer("i", (8,), torch.int32)
    p.copy(x[0:4], i[0:4], name="conv")
    raises(r"op 'conv' \(copy\): src i\[0:4\] is int32 but dst x\[0:4\] is float32", check_plan, p.data())
    p = ho.Plan("loc")
    x = p.buffer("x", (8,), torch.float32)
    p.reduce(x[0:4], x[4:7], name="short")
    raises(r"op 'short' \(reduce\): src x\[4:7\] has 3 elements but dst x\[0:4\] has 4", check_plan, p.data())
    p = ho.Plan("loc")
    x = p.buffer("x", (8,), torch.float32)
    p.copy(x[0:4], x[2:6], name="ovl")
    raises(r"op 'ovl' \(copy\): src x\[2:6\] and dst x\[0:4\] overlap", check_plan, p.data())
    p = ho.Plan("loc")
    x = p.buffer("x", (8,), torch.float32)
    p.reduce(x[0:4], x[4:8], op="avg", name="r")
    raises(r"op 'r' \(reduce\): op must be one of", check_plan, p.data())
    p = ho.Plan("loc")
    x = p.buffer("x", (8,), torch.float32)
    p.copy(x[0:4], ho.Region("nobuf", ((0, 4),)), name="c")
    raises(r"op 'c' \(copy\): src names buffer 'nobuf', which this plan does not register", check_plan, p.data())


def test_peer_out_of_range():
    p = ho.Plan("peer", world_size=2)
    x = p.buffer("x", 4, torch.float32)
    p.send(x[0:2], peer=2, name="far")
    raises(r"op 'far' \(send to rank 2\): peer must be a group rank in \[0, 2\), got 2", check_plan, p.data())


def test_unmatched_send_and_recv_across_ranks():
    plans_ = pair(lambda p, x: p.send(x[0], 1, name="s0"), lambda p, x: None)
    e = raises(r"rank 0 op 's0' \(send to rank 1\) \(tag 0\) has no matching recv on rank 1: rank 1 posts 0 recvs "
               r"from rank 0 with tag 0", compile_group, plans_)
    assert (e.rank, e.op) == (0, "s0")
    plans_ = pair(lambda p, x: p.send(x[0], 1, tag=3), lambda p, x: p.recv(x[0], 0, tag=4, name="r"))
    raises(r"has no matching recv on rank 1", compile_group, plans_)
    plans_ = pair(lambda p, x: None, lambda p, x: p.recv(x[1], 0, name="lonely"))
    raises(r"rank 1 op 'lonely' \(recv from rank 0\) \(tag 0\) has no matching send on rank 0", compile_group, plans_)


def test_size_and_dtype_mismatch_across_ranks():
    plans_ = pair(lambda p, x: p.send(x[0, 0:4], 1, name="s"), lambda p, x: p.recv(x[0, 0:3], 0, name="r"))
    raises(r"rank 0 op 's' \(send to rank 1\) sends 4 float32 elements \(x\[0:1, 0:4\]\) but rank 1 op 'r' "
           r"\(recv from rank 0\) receives 3 float32 elements", compile_group, plans_)

    def int_recv(p, x):
        y = p.buffer("y", 4, torch.int32)
        p.recv(y[0:4], 0, name="r")

    plans_ = pair(lambda p, x: p.send(x[0, 0:4], 1, name="s"), int_recv)
    raises(r"sends 4 float32 elements .* receives 4 int32 elements", compile_group, plans_)
    # element counts match, shapes differ: allowed (C order, like MPI type signatures)
    plans_ = pair(lambda p, x: p.send(x[0:2, 0:4], 1), lambda p, x: p.recv(x[3, 0:8], 0))
    compile_group(plans_)


def test_put_and_get_checked_against_target_buffer():
    def put_far(p, x):
        p.put(x[0], 1, ho.Region("x", ((0, 1), (4, 12))), name="p")

    raises(r"op 'p' \(put to rank 1\): dst x\[0:1, 4:12\] is out of range for buffer 'x' of shape \(4, 8\) on rank 1",
           compile_group, pair(put_far, lambda p, x: None))

    def get_missing(p, x):
        p.get(x[0], 1, ho.Region("w", ((0, 8),)), name="g")

    raises(r"op 'g' \(get from rank 1\): src names buffer 'w', which 1 does not register",
           compile_group, pair(lambda p, x: None, get_missing))
    ok = compile_group(pair(lambda p, x: p.put(x[0], 1, x[2], name="p"), lambda p, x: None))
    assert [(o.kind, o.name) for o in ok[1].ops] == [("recv", "p@0")]
    assert ok[0].ops[0].message == ok[1].ops[0].message


def test_cross_rank_deadlock_rejected():
    def r0(p, x):
        a = p.recv(x[0], 1, name="wait_b")
        p.send(x[1], 1, after=[a], name="send_a")

    def r1(p, x):
        b = p.recv(x[0], 0, name="wait_a")
        p.send(x[1], 0, after=[b], name="send_b")

    e = raises(r"plan 'p' deadlocks: .*rank 0 'send_a' \(send to rank 1\) = rank 1 'wait_a' \(recv from rank 0\) -> "
               r"rank 0 'wait_b' \(recv from rank 1\) = rank 1 'send_b' \(send to rank 0\) -> back to the first",
               compile_group, pair(r0, r1))
    assert e.rank is not None
    # the same exchange ordered safely (send first on one side) passes
    def r1_safe(p, x):
        s = p.send(x[1], 0, name="send_b")
        p.recv(x[0], 0, after=[s], name="wait_a")

    compile_group(pair(r0, r1_safe))


def test_plan_for_another_rank_or_world():
    plans_ = [plans.alltoall(1, 2, 4, torch.float32).data(), plans.alltoall(1, 2, 4, torch.float32).data()]
    raises(r"rank 0: plan 'alltoall' was built for rank 1 but is compiled on rank 0", compile_group, plans_)
    plans_ = [plans.alltoall(r, 3, 4, torch.float32).data() for r in range(2)]
    raises(r"built for world_size 3 but the group has 2 ranks", compile_group, plans_)


def test_wire_tags_unique_per_endpoint_pair():
    P = 4
    cps = compile_group([plans.allreduce(r, P, 10, torch.float32, algorithm="direct").data() for r in range(P)],
                        key=7, endpoints=[0, 0, 1, 1])
    seen = {}
    for cp in cps:
        for op in cp.ops:
            if op.kind == "send" and op.message is not None:
                local = cp.endpoints[cp.rank] == cp.endpoints[op.peer]
                assert (op.wire_tag is None) == local
                if not local:
                    k = (cp.endpoints[cp.rank], cp.endpoints[op.peer], op.wire_tag)
                    assert k not in seen
                    seen[k] = op
                    assert op.wire_tag >> 16 == 7


def test_progress_thread_that_does_not_start_raises():
    class Stuck(Executor):
        def run(self, started=None):  # never signals that it runs
            time.sleep(2)

    ex = Stuck()
    t0 = time.monotonic()
    with pytest.raises(ho.OffloadError, match="progress thread did not start within 0s"):
        ex.start_thread(timeout=0.3)
    assert time.monotonic() - t0 < 2
    assert threading.active_count() >= 1


def test_shared_memory_buffers_and_a_full_directory():
    t = ho.empty((3, 4), torch.int32)
    t += 7
    h = ho.shm.handle_of(t[1])
    assert h.offset == 16 and h.shape == (4,) and ho.shm.Mapper().tensor(h).tolist() == [7] * 4
    assert ho.shm.handle_of(torch.zeros(3)) is None
    with pytest.raises(ho.OffloadError, match="cannot allocate .* bytes of shared memory in .*HPDL_OFFLOAD_SHM_DIR"):
        ho.empty((1 << 50,), torch.uint8)


def test_more_messages_between_two_endpoints_than_wire_tags_is_rejected(monkeypatch):
    from hpdl.offload import compiler

    monkeypatch.setattr(compiler, "TAG_MESSAGE_BITS", 4)  # 16 messages a pair instead of 65536: a fast test
    n = 17
    ps = []
    for r in range(2):
        p = ho.Plan("crowded", rank=r, world_size=2)
        x = p.buffer("x", (n,), torch.float32)
        for i in range(n):
            (p.send if r == 0 else p.recv)(x[i:i + 1], 1 - r)
        ps.append(p.data())
    with pytest.raises(ho.PlanError, match=r"17 messages from endpoint 0 to endpoint 1, more than the 16"):
        ho.compile_group(ps, key=1, endpoints=[0, 1])
    assert len(ho.compile_group(ps, key=1, endpoints=[0, 0])[0].ops) == n  # one endpoint: copies, no tags


def test_a_plan_whose_wire_tags_a_live_plan_holds_is_refused():
    from hpdl.offload import shm
    import torch.distributed as dist

    from hpdl.comm.transport.gloo import GlooTransport
    from hpdl.offload.executor import Executor, Instance

    def inst(key, slot, t, boxes):
        p = ho.Plan("p", rank=0, world_size=2)
        x = p.buffer("x", (4,), torch.float32)
        p.send(x[0:2], 1)
        p.recv(x[2:4], 1)
        q = ho.Plan("p", rank=1, world_size=2)
        y = q.buffer("x", (4,), torch.float32)
        q.recv(y[0:2], 0)
        q.send(y[2:4], 0)
        c = ho.compile_group([p.data(), q.data()], key=key, endpoints=[0, 1])[0]
        return Instance(c, {"x": torch.zeros(4)}, boxes.array, slot, t, "s", "rank 0")

    t = GlooTransport.create(dist.HashStore(), 0, 1, 10.0)  # registration only: nothing is sent
    ex, boxes = Executor(), shm.Mailboxes(4, shared=False)
    a, b = inst(5, 0, t, boxes), inst(5 + 32768, 1, t, boxes)
    ex.register(a)
    with pytest.raises(ho.OffloadError, match=r"key 32773\) would share wire tags with live plan 'p' \(key 5\)"):
        ex.register(b)
    ex.register(inst(6, 2, t, boxes))  # another key is fine
    ex.free(a)
    ex.register(b)  # once the first is freed


def test_allreduce_builder_checks_op_and_window_up_front():
    """plans.allreduce (and so allreduce_init) names a bad ``op``/``window`` argument, at every world size,
    instead of an IndexError or a compile error about an internal 'rs_reduce0' operation; c10d's ReduceOp and
    hpdl.comm's 'product' spelling are accepted (users port them from torch.distributed / hpdl.comm)."""
    for P in (1, 4):
        with pytest.raises(ValueError, match=r"op must be one of .*got 'avg'"):
            plans.allreduce(0, P, 8, torch.float32, op="avg")
    for window in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="window must be an int >= 1 or None"):
            plans.allreduce(0, 4, 8, torch.float32, algorithm="direct", window=window)
    import torch.distributed as dist
    xs = [torch.arange(5, dtype=torch.float32) + r + 1 for r in range(3)]
    for op, alias, want in (("sum", dist.ReduceOp.SUM, sum(xs)), ("prod", "product", xs[0] * xs[1] * xs[2]),
                            ("max", dist.ReduceOp.MAX, xs[2])):
        ps = [plans.allreduce(r, 3, 5, torch.float32, op=alias) for r in range(3)]
        out = ho.simulate(ps, [{"data": x.clone()} for x in xs])
        assert all(torch.equal(o["data"], want) for o in out), op


def test_agent_and_compile_outside_a_distributed_job_say_how_to_join_one():
    """A new user's first try in a plain interpreter: both name the fix (torch.distributed's own message for
    Agent() was 'Default process group has not been initialized')."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("this process is already in a job")
    for fn in (lambda: ho.Agent().start(), lambda: ho.compile(plans.alltoall(0, 1, 1, torch.float32))):
        with pytest.raises(RuntimeError, match=r"torch.distributed is not initialised: call "
                                               r"hpdl.runtime.init_from_env\(\)"):
            fn()


@pytest.mark.parametrize("kw, name", [({"threads": 0}, "threads"), ({"threads": -1}, "threads"),
                                      ({"threads": 1.5}, "threads"), ({"spin_us": -1}, "spin_us"),
                                      ({"timeout": 0}, "timeout"), ({"start_timeout": -5}, "start_timeout")])
def test_agent_arguments_are_checked_where_they_are_given(kw, name):
    """Agent(threads=0) was an AgentError carrying the agent subprocess's argparse usage, after spawning it."""
    with pytest.raises(ValueError, match=f"^{name} must be"):
        ho.Agent(**kw)


def test_a_bad_progress_from_the_environment_names_the_variable(monkeypatch):
    """HPDL_OFFLOAD_PROGRESS=agnet was reported as "progress must be one of ..., got None"."""
    from hpdl.offload.api import _resolve_progress
    monkeypatch.setenv("HPDL_OFFLOAD_PROGRESS", "agnet")
    with pytest.raises(ho.PlanError, match=r"HPDL_OFFLOAD_PROGRESS must be one of .*got 'agnet'"):
        _resolve_progress(None)
    with pytest.raises(ho.PlanError, match=r"^progress must be one of .*got 'bogus'"):
        _resolve_progress("bogus")
    monkeypatch.setenv("HPDL_OFFLOAD_PROGRESS", "graph")  # a documented value of the variable
    assert _resolve_progress(None) == ("graph", None)


def test_simulate_on_the_native_engine_says_what_it_cannot_run():
    """simulate(engine="native") of a float16 Allreduce was a bare KeyError: 'float16'."""
    from hpdl.offload import native
    if native.load() is None:
        pytest.skip("no native executor here")
    ps = [plans.allreduce(r, 2, 4, torch.float16) for r in range(2)]
    with pytest.raises(native.NativeUnavailable, match=r"rank 0: reduction of float16.*engine='python'"):
        ho.simulate(ps, [{"data": torch.ones(4, dtype=torch.float16)} for _ in range(2)], engine="native")
