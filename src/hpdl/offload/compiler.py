"""Plan validation and compilation: pure functions of plain data (no processes, no tensors).

:func:`check_plan` validates one rank's plan; :func:`compile_group` takes every rank's plan, matches sends
with receives across ranks, turns each ``put``/``get`` into a send on one side and a receive on the other,
rejects plans that would deadlock, and returns one :class:`CompiledPlan` per rank: the executor's input.

Matching follows MPI's non-overtaking rule: the k-th send from rank a to rank b with tag t (in declaration
order) matches the k-th receive on b from a with tag t. The deadlock check treats every message as a
rendezvous (neither half completes before both are ready), MPI's definition of a *safe* program: a plan that
passes runs whatever the transport buffers.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Sequence

from hpdl.offload.errors import PlanError
from hpdl.offload.plan import KINDS, REDUCE_OPS, BufferSpec, Op, PlanData, Region

TAG_MESSAGE_BITS = 16  # wire tag = (plan key % 2**15) << 16 | message number between two endpoints
TAG_KEY_BITS = 15      # gloo tags are 31-bit non-negative ints


@dataclass(frozen=True)
class CompiledOp:
    """One executable operation of one rank.

    ``kind`` is send, recv, copy or reduce (put and get became a send and a recv). ``deps`` are indices into
    the rank's ops. ``message`` identifies the matched transfer (the same id on both ranks); ``wire_tag`` is
    the transport tag when the two ranks are served by different endpoints, None when one endpoint copies.
    """

    index: int
    kind: str
    name: str
    deps: tuple[int, ...]
    src: Region | None = None
    dst: Region | None = None
    peer: int | None = None
    message: int | None = None
    wire_tag: int | None = None
    reduce_op: str | None = None

    def describe(self) -> str:
        where = {"send": f" to rank {self.peer}", "recv": f" from rank {self.peer}"}.get(self.kind, "")
        return f"{self.name!r} ({self.kind}{where})"


@dataclass(frozen=True)
class CompiledPlan:
    """A rank's validated plan, ready to register with an executor.

    Attributes:
        key: plan id, unique among the live plans of the engine (agents or the process's progress thread).
        endpoints: ``endpoints[q]`` is the endpoint (agent, or process) that executes group rank q's ops;
            messages between ranks of one endpoint are copies, others go over the transport.
    """

    name: str
    rank: int
    world_size: int
    key: int
    buffers: tuple[BufferSpec, ...]
    ops: tuple[CompiledOp, ...]
    endpoints: tuple[int, ...]

    def buffer(self, name: str) -> BufferSpec:
        return next(b for b in self.buffers if b.name == name)


def _fail(msg: str, op: Op | None = None, rank: int | None = None):
    where = f"rank {rank}: " if rank is not None else ""
    raise PlanError(where + msg, op=op.name if op is not None else None, rank=rank)


def _check_region(region: Region, spec: BufferSpec | None, op: Op, role: str, rank, whose: str = "") -> None:
    if spec is None:
        _fail(f"{op.describe()}: {role} names buffer {region.buffer!r}, which {whose or 'this plan'} does not "
              f"register", op, rank)
    if len(region.box) != len(spec.shape):
        _fail(f"{op.describe()}: {role} {region} has {len(region.box)} dimensions, buffer {spec.name!r} has "
              f"shape {spec.shape}", op, rank)
    for d, ((a, b), n) in enumerate(zip(region.box, spec.shape)):
        if not (0 <= a <= b <= n):
            _fail(f"{op.describe()}: {role} {region} is out of range for buffer {spec.name!r} of shape {spec.shape}"
                  f"{' on rank ' + whose if whose else ''}: dim {d} needs 0 <= {a} <= {b} <= {n}", op, rank)


def _overlap(a: Region, b: Region) -> bool:
    return a.buffer == b.buffer and all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a.box, b.box)) \
        and a.numel > 0 and b.numel > 0


def check_plan(plan: PlanData, world_size: int | None = None, rank: int | None = None) -> list[tuple[int, ...]]:
    """Validate one rank's plan on its own; returns the resolved dependency indices of every op.

    Checks: first, that a plan written for a rank or world size (``Plan(rank=, world_size=)``) is checked for
    that one; buffer names and shapes; every op's kind, regions (registered buffer, dimensions, in range), peer
    (``0 <= peer < world_size``) and tag; copy and reduce dtypes and element counts; dependencies (known
    names, no op depending on itself, no cycle).

    Raises:
        PlanError: naming the operation (and ``rank`` when given).
    """
    # before the ops: a grid whose product is not the group size otherwise reads as "peer out of range"
    if rank is not None and plan.rank is not None and plan.rank != rank:
        _fail(f"plan {plan.name!r} was built for rank {plan.rank} but is compiled on rank {rank}", None, rank)
    if world_size is not None and plan.world_size is not None and plan.world_size != world_size:
        _fail(f"plan {plan.name!r} was built for world_size {plan.world_size} but the group has {world_size} "
              "ranks", None, rank)
    world_size = plan.world_size if world_size is None else world_size
    specs: dict[str, BufferSpec] = {}
    for b in plan.buffers:
        if b.name in specs:
            _fail(f"plan {plan.name!r}: buffer {b.name!r} is registered twice", None, rank)
        specs[b.name] = b
    names = {}
    for i, op in enumerate(plan.ops):
        if op.index != i:
            _fail(f"{op.describe()}: index {op.index} != its position {i}", op, rank)
        if op.name in names:
            _fail(f"plan {plan.name!r}: op name {op.name!r} is used twice", op, rank)
        names[op.name] = i
    deps_of: list[tuple[int, ...]] = []
    for op in plan.ops:
        if op.kind not in KINDS:
            _fail(f"{op.describe()}: kind must be one of {KINDS}", op, rank)
        local_src = op.kind in ("send", "put", "copy", "reduce")
        local_dst = op.kind in ("recv", "get", "copy", "reduce")
        for role, region, local in (("src", op.src, local_src), ("dst", op.dst, local_dst)):
            needed = local or op.kind in ("put", "get")
            if needed and region is None:
                _fail(f"{op.describe()}: needs a {role} region", op, rank)
            if region is not None and local:
                _check_region(region, specs.get(region.buffer), op, role, rank)
        if op.kind in ("send", "recv", "put", "get"):
            if isinstance(op.peer, bool) or not isinstance(op.peer, int) or op.peer < 0 or \
                    (world_size is not None and op.peer >= world_size):
                _fail(f"{op.describe()}: peer must be a group rank in [0, {world_size}), got {op.peer!r}", op, rank)
            if isinstance(op.tag, bool) or not isinstance(op.tag, int) or op.tag < 0:
                _fail(f"{op.describe()}: tag must be an int >= 0, got {op.tag!r}", op, rank)
        if op.kind in ("copy", "reduce"):
            s, d = specs[op.src.buffer], specs[op.dst.buffer]
            if s.dtype != d.dtype:
                _fail(f"{op.describe()}: src {op.src} is {s.dtype} but dst {op.dst} is {d.dtype} "
                      "(no conversion; use buffers of one dtype)", op, rank)
            if op.src.numel != op.dst.numel:
                _fail(f"{op.describe()}: src {op.src} has {op.src.numel} elements but dst {op.dst} has "
                      f"{op.dst.numel}", op, rank)
            if _overlap(op.src, op.dst):
                _fail(f"{op.describe()}: src {op.src} and dst {op.dst} overlap", op, rank)
        if op.kind == "reduce":
            if op.reduce_op not in REDUCE_OPS:
                _fail(f"{op.describe()}: op must be one of {REDUCE_OPS}, got {op.reduce_op!r}", op, rank)
            if specs[op.dst.buffer].dtype == "bool" and op.reduce_op in ("sum", "prod"):
                _fail(f"{op.describe()}: {op.reduce_op} of bool buffers is not defined; use min/max", op, rank)
        deps = []
        for a in op.after:
            j = a if isinstance(a, int) and not isinstance(a, bool) else names.get(a)
            if j is None or not (0 <= j < len(plan.ops)):
                _fail(f"{op.describe()}: after= names {a!r}, which is not an op of plan {plan.name!r}", op, rank)
            if j == op.index:
                _fail(f"{op.describe()}: depends on itself", op, rank)
            deps.append(j)
        deps_of.append(tuple(dict.fromkeys(deps)))
    cycle = _find_cycle(len(plan.ops), deps_of)
    if cycle:
        op = plan.ops[cycle[0]]
        path = " -> ".join(repr(plan.ops[i].name) for i in cycle + [cycle[0]])
        _fail(f"{op.describe()} is on a dependency cycle ({path}: each waits for the next)", op, rank)
    return deps_of


def _find_cycle(n: int, deps_of: Sequence[Sequence[int]]) -> list[int]:
    """Nodes of one cycle, in wait-for order (each waits for the next), or [] (Kahn, then a walk)."""
    indeg = [len(d) for d in deps_of]
    users: list[list[int]] = [[] for _ in range(n)]
    for i, ds in enumerate(deps_of):
        for j in ds:
            users[j].append(i)
    queue = deque(i for i in range(n) if indeg[i] == 0)
    done = 0
    while queue:
        i = queue.popleft()
        done += 1
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                queue.append(u)
    if done == n:
        return []
    left = {i for i in range(n) if indeg[i] > 0}
    node, seen = min(left), {}
    path: list[int] = []
    while node not in seen:  # every unfinished node waits for some unfinished node: walk until a repeat
        seen[node] = len(path)
        path.append(node)
        node = next(j for j in deps_of[node] if j in left)
    return path[seen[node]:]


def compile_group(plans: Sequence[PlanData], key: int = 0,
                  endpoints: Sequence[int] | None = None) -> list[CompiledPlan]:
    """Validate every rank's plan together and compile them (``plans[q]`` is group rank q's plan).

    Args:
        key: the plan id (unique among live plans of the executing engine); wire tags derive from it.
        endpoints: ``endpoints[q]`` executes rank q's ops (agent index, or q itself in-process); default
            every rank its own endpoint.

    Returns:
        One :class:`CompiledPlan` per rank, identical on every rank that runs this (it is deterministic).

    Raises:
        PlanError: the first problem found, naming the rank and operation: any :func:`check_plan` error; a
            plan written for another rank or world size; a send, recv, put or get without its other half;
            element count or dtype mismatches; a put/get box outside the target's buffer; a deadlock.
    """
    world = len(plans)
    endpoints = tuple(range(world)) if endpoints is None else tuple(endpoints)
    if len(endpoints) != world:
        raise PlanError(f"endpoints has {len(endpoints)} entries for {world} ranks")
    deps_of = []
    for q, p in enumerate(plans):
        if p.rank is not None and p.rank != q:
            _fail(f"plan {p.name!r} was built for rank {p.rank} but is compiled on rank {q}", None, q)
        if p.world_size is not None and p.world_size != world:
            _fail(f"plan {p.name!r} was built for world_size {p.world_size} but the group has {world} ranks",
                  None, q)
        deps_of.append(check_plan(p, world, q))
    names = {p.name for p in plans}
    if len(names) > 1:
        _fail(f"ranks compile different plans: {sorted(names)} (every rank of the group calls compile together)")
    specs = [{b.name: b for b in p.buffers} for p in plans]

    # per rank: (kind, op, region, peer, tag) of every transfer half, in declaration order
    sends: dict[tuple[int, int, int], list[tuple[int, Op, Region, str]]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[tuple[int, Op, Region, str]]] = defaultdict(list)
    one_sided = []
    for q, p in enumerate(plans):
        for op in p.ops:
            if op.kind == "send":
                sends[(q, op.peer, op.tag)].append((q, op, op.src, specs[q][op.src.buffer].dtype))
            elif op.kind == "recv":
                recvs[(op.peer, q, op.tag)].append((q, op, op.dst, specs[q][op.dst.buffer].dtype))
            elif op.kind in ("put", "get"):
                one_sided.append((q, op))

    extra: list[list[dict]] = [[] for _ in plans]  # synthesized target halves of put/get
    messages = []  # (src_rank, src_index or extra-id, dst_rank, dst_index or extra-id)

    for k in sorted(set(sends) | set(recvs)):
        a, b, tag = k
        ss, rr = sends.get(k, []), recvs.get(k, [])
        for (qa, so, sreg, sdt), (qb, ro, rreg, rdt) in zip(ss, rr):
            if sreg.numel != rreg.numel or sdt != rdt:
                raise PlanError(f"rank {qa} {so.describe()} sends {sreg.numel} {sdt} elements ({sreg}) but rank "
                                f"{qb} {ro.describe()} receives {rreg.numel} {rdt} elements ({rreg}) (tag {tag})",
                                op=so.name, rank=qa)
            messages.append(((qa, ("op", so.index)), (qb, ("op", ro.index))))
        if len(ss) != len(rr):
            extra_side, other = (ss, "recv") if len(ss) > len(rr) else (rr, "send")
            q, op, _, _ = extra_side[min(len(ss), len(rr))]
            peer, me = (b, a) if other == "recv" else (a, b)
            raise PlanError(f"rank {q} {op.describe()} (tag {tag}) has no matching {other} on rank {peer}: rank "
                            f"{peer} posts {min(len(ss), len(rr))} {other}s {'from' if other == 'recv' else 'to'} "
                            f"rank {me} with tag {tag}, rank {q} posts {len(extra_side)} "
                            f"{'sends' if other == 'recv' else 'recvs'}", op=op.name, rank=q)

    for q, op in one_sided:
        t = op.peer
        remote = op.dst if op.kind == "put" else op.src
        local = op.src if op.kind == "put" else op.dst
        tspec = specs[t].get(remote.buffer)
        _check_region(remote, tspec, op, "dst" if op.kind == "put" else "src", q, whose=str(t))
        ldt = specs[q][local.buffer].dtype
        if tspec.dtype != ldt or remote.numel != local.numel:
            _fail(f"{op.describe()}: local {local} is {local.numel} {ldt} elements but rank {t}'s {remote} is "
                  f"{remote.numel} {tspec.dtype}", op, q)
        j = len(extra[t])
        if op.kind == "put":  # origin sends, target receives into its buffer
            extra[t].append(dict(kind="recv", name=f"{op.name}@{q}", dst=remote, peer=q))
            messages.append(((q, ("op", op.index)), (t, ("extra", j))))
        else:
            extra[t].append(dict(kind="send", name=f"{op.name}@{q}", src=remote, peer=q))
            messages.append(((t, ("extra", j)), (q, ("op", op.index))))

    # final indices: declared ops first, then synthesized halves
    def index_of(q, ref):
        return ref[1] if ref[0] == "op" else len(plans[q].ops) + ref[1]

    msg_of: dict[tuple[int, int], int] = {}
    pair_count: dict[tuple[int, int], int] = defaultdict(int)
    wire: dict[int, int | None] = {}
    for mid, ((qa, ra), (qb, rb)) in enumerate(messages):
        msg_of[(qa, index_of(qa, ra))] = mid
        msg_of[(qb, index_of(qb, rb))] = mid
        ea, eb = endpoints[qa], endpoints[qb]
        if ea == eb:
            wire[mid] = None
        else:
            n = pair_count[(ea, eb)]
            pair_count[(ea, eb)] += 1
            wire[mid] = ((key % (1 << TAG_KEY_BITS)) << TAG_MESSAGE_BITS) | (n % (1 << TAG_MESSAGE_BITS))

    crowded = [(pair, n) for pair, n in pair_count.items() if n > 1 << TAG_MESSAGE_BITS]
    if crowded:  # the message part of the wire tag would repeat within the plan: messages could swap
        (ea, eb), n = crowded[0]
        raise PlanError(f"plan {plans[0].name!r} has {n} messages from endpoint {ea} to endpoint {eb}, more than "
                        f"the {1 << TAG_MESSAGE_BITS} one plan can tell apart on the wire: merge small messages "
                        "into larger boxes or split the plan")

    result = []
    for q, p in enumerate(plans):
        ops = []
        for op in p.ops:
            kind = {"put": "send", "get": "recv"}.get(op.kind, op.kind)
            src = op.src if kind in ("send", "copy", "reduce") else None
            dst = op.dst if kind in ("recv", "copy", "reduce") else None
            mid = msg_of.get((q, op.index))
            ops.append(CompiledOp(op.index, kind, op.name, deps_of[q][op.index], src, dst,
                                  op.peer if mid is not None else None, mid, wire.get(mid), op.reduce_op))
        for j, e in enumerate(extra[q]):
            i = len(p.ops) + j
            mid = msg_of[(q, i)]
            ops.append(CompiledOp(i, e["kind"], e["name"], (), e.get("src"), e.get("dst"), e["peer"], mid,
                                  wire[mid]))
        result.append(CompiledPlan(p.name, q, world, key, p.buffers, tuple(ops), endpoints))
    _check_deadlock(result, messages, index_of)
    return result


def _check_deadlock(plans: list[CompiledPlan], messages, index_of) -> None:
    """Reject plans whose operations wait for each other in a cycle across ranks (messages as rendezvous)."""
    base, n = [], 0
    for p in plans:
        base.append(n)
        n += len(p.ops)
    node = list(range(n))  # both halves of a message become one node
    for (qa, ra), (qb, rb) in messages:
        node[base[qb] + index_of(qb, rb)] = base[qa] + index_of(qa, ra)
    deps_of: list[set[int]] = [set() for _ in range(n)]
    for q, p in enumerate(plans):
        for op in p.ops:
            me = node[base[q] + op.index]
            deps_of[me].update(node[base[q] + d] for d in op.deps)
    cycle = _find_cycle(n, [sorted(d) for d in deps_of])
    if not cycle:
        return
    where = {}
    for q, p in enumerate(plans):
        for op in p.ops:
            where.setdefault(node[base[q] + op.index], []).append((q, op))
    steps = []
    for c in cycle:
        steps.append(" = ".join(f"rank {q} {op.describe()}" for q, op in where[c]))
    q, op = where[cycle[0]][0]
    raise PlanError(f"plan {plans[0].name!r} deadlocks: operations wait for each other in a cycle across ranks "
                    f"(a message completes only when both its send and its recv are ready): "
                    + " -> ".join(steps) + " -> back to the first", op=op.name, rank=q)
