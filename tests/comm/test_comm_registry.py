"""The architecture's invariants for hpdl.comm, checked without communication: one selection table for every
collective, every name in it an Algorithm subclass, no algorithm importing the API, and the constants the
Python side shares with the CUDA kernels equal to the kernels' own."""

import ast
import re
from pathlib import Path

import pytest

import hpdl.comm as hc
from hpdl.comm import tuning
from hpdl.comm.algorithms import peer, peer_alltoall
from hpdl.comm.algorithms.base import BASES, REGISTRY, Algorithm, algorithms_for, get_class, implements

COMM = Path(hc.__file__).parent


def test_every_algorithm_in_the_table_and_registry_is_an_algorithm_subclass():
    names = {r.algorithm for r in tuning.default_table().rules} | set(REGISTRY)
    for name in sorted(names):
        cls = get_class(name)
        assert isinstance(cls, type) and issubclass(cls, Algorithm), name
        assert any(issubclass(cls, base) for base in BASES.values()), name   # implements some collective
    assert {r.collective for r in tuning.default_table().rules} <= set(tuning.COLLECTIVES) == set(BASES)
    # every rule names an algorithm of its own collective's base class
    for rule in tuning.default_table().rules:
        assert issubclass(get_class(rule.algorithm), BASES[rule.collective]), rule


def test_per_collective_bases_and_one_constructor():
    import inspect

    assert algorithms_for("all_to_all") == ["direct", "native", "pairwise", "push", "pull"]
    assert algorithms_for("reduce_scatter") == algorithms_for("all_gather") == ["direct", "ring", "native"]
    assert not implements("push", "all_reduce") and not implements("one_shot", "all_to_all")
    for name in REGISTRY:
        cls = get_class(name)
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        assert [p.name for p in params[:3]] == ["resources", "window", "timeout"], name
        assert all(p.kind is p.KEYWORD_ONLY for p in params[3:]), name   # options after the common three
        for base in BASES.values():
            if issubclass(cls, base):
                assert not getattr(cls, "__abstractmethods__", None), (name, base)   # every method implemented
    for name in ("direct", "ring", "recursive_doubling", "native", "pairwise"):
        assert get_class(name)(None, 3, 1.0).window == 3
    with pytest.raises(ValueError, match="resolve it first"):
        get_class("auto")
    with pytest.raises(TypeError):
        BASES["all_reduce"](None)   # an ABC: no instance without the collective's method


def test_peer_buffers_are_owned_by_group_resources():
    """No module-level registration caches: the peer modules register through GroupResources, and the API
    forgets a group by closing its resources, never by reaching into an algorithm module."""
    for mod in (peer, peer_alltoall):
        assert not hasattr(mod, "_COMMS") and not hasattr(mod, "forget"), mod.__name__
    api_src = (COMM / "api.py").read_text()
    for node in ast.walk(ast.parse(api_src)):
        if isinstance(node, ast.ImportFrom):
            mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            assert not any(m.startswith("hpdl.comm.algorithms.peer") for m in mods), mods
    for private in ("_COMMS", "_STATES", "_GroupState"):
        assert private not in api_src, private


def test_one_table_for_every_collective():
    t = tuning.default_table()
    assert t.select("all_reduce", 8, 4, "cpu")[0] == "native"   # gloo's own at latency-bound sizes (issue 41)
    assert t.select("all_reduce", 256 << 10, 4, "cpu")[0] == "direct"
    assert t.select("allreduce", 8, 4, "cpu") == t.select(8, 4, "cpu")            # old positional form
    assert t.select("all_to_all", 1 << 20, 2, "cuda")[0] == "push"
    assert t.select("all_to_all", 1 << 20, 4, "cuda")[0] == "native"
    assert t.select("all_to_all", 8, 8, "cpu")[0] == "native"
    assert t.select("all_to_all", 8, 1, "cuda")[0] == "native"
    # reduce_scatter / all_gather follow the all_reduce rules, mapped to a schedule with both phases
    assert t.select("reduce_scatter", 8, 4, "cpu")[0] == "native"
    assert t.select("reduce_scatter", 256 << 10, 4, "cpu")[0] == "direct"
    assert t.select("all_gather", 256 << 10, 4, "cpu")[0] == "direct"
    assert t.select("reduce_scatter", 8, 2, "cuda")[0] == "direct"
    # broadcast / reduce / barrier have no rules yet: native until a measured table says otherwise
    assert t.select("broadcast", 8, 2, "cpu") == t.select("barrier", 0, 4, "cuda") == ("native", None)
    with pytest.raises(ValueError, match="collective must be one of"):
        t.select("scatter", 8, 2, "cpu")


def test_topology_of_several_nodes_excludes_one_node_kernels():
    from hpdl.runtime.topology import Topology

    two_nodes = Topology.emulate(4, 2)
    one_node = Topology.emulate(2, 2)
    assert hc.resolve("all_reduce", 8, 2, "cuda", one_node)[0] == "one_shot"
    assert hc.resolve("all_reduce", 8, 4, "cuda", two_nodes)[0] == "native"
    assert hc.resolve("all_to_all", 8, 2, "cuda", one_node)[0] == "push"


def test_one_json_format_with_every_collective(tmp_path):
    t = tuning.TuningTable([tuning.Rule("cpu", 100, "ring"),
                            tuning.Rule("cpu", tuning.INF, "pairwise", collective="all_to_all")], "x")
    back = tuning.TuningTable.from_json(t.to_json())
    assert back.rules == t.rules
    assert back.select("all_to_all", 5, 4, "cpu")[0] == "pairwise"
    # a file written before the collective field: all_reduce rules; all_to_all keeps the default rules
    old = tuning.TuningTable.from_json('{"rules": [{"device": "cpu", "max_bytes": 100, "algorithm": "ring"}]}')
    assert old.select("all_reduce", 50, 4, "cpu")[0] == "ring"
    assert old.select("all_to_all", 1 << 20, 2, "cuda")[0] == "push"
    from hpdl.comm.algorithms import alltoall

    assert not hasattr(alltoall, "AUTO_RULES") and not hasattr(peer, "default_algorithm")


def test_no_algorithm_or_transport_module_imports_the_api():
    for path in list((COMM / "algorithms").glob("*.py")) + list((COMM / "transport").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                assert m not in ("hpdl.comm.api", "hpdl.comm") and not m.startswith("hpdl.bench"), (path.name, m)


def _enum(text: str, name: str) -> dict[str, int]:
    body = re.search(rf"enum {name} : int \{{([^}}]*)\}}", text).group(1)
    return {k.strip(): int(v) for k, v in (item.split("=") for item in body.split(",") if item.strip())}


def _const(text: str, name: str) -> int:
    expr = re.search(rf"constexpr (?:int|long long) {name} = ([^;]+);", text).group(1)
    expr = re.sub(r"\(long long\)|(?<=\d)LL", "", expr)
    names = {k: _const(text, k) for k in set(re.findall(r"\bk[A-Z]\w*", expr))}
    return int(eval(expr, {}, names))  # noqa: S307 - integer arithmetic from our own header


def test_python_constants_match_the_kernel_header():
    h = (COMM / "transport" / "kernels" / "peer_args.h").read_text()
    assert _const(h, "kMaxRanks") == peer.MAX_RANKS == peer_alltoall.MAX_RANKS
    assert _const(h, "kMaxBlocks") == peer.MAX_BLOCKS == peer_alltoall.MAX_BLOCKS
    assert _const(h, "kHeaderBytes") == peer.HEADER_BYTES == peer_alltoall.HEADER_BYTES
    assert _const(h, "kThreads") == peer.MIN_CHUNK_UNITS == peer_alltoall.MIN_CHUNK // 16
    assert _enum(h, "Op") == {"k" + k.capitalize(): v for k, v in peer.OPS.items()}
    assert _enum(h, "Algo") == {"kOneShot": peer.VARIANTS["one_shot_barrier"], "kTwoShot": peer.VARIANTS["two_shot"],
                                "kOneShotLL": peer.VARIANTS["one_shot_ll"]}
    assert _const(h, "kNumAlgos") == len(peer.VARIANTS)
    names = {"kF32": "float32", "kF16": "float16", "kBF16": "bfloat16", "kI32": "int32", "kI64": "int64"}
    assert {names[k]: v for k, v in _enum(h, "DType").items()} == {str(d).removeprefix("torch."): v
                                                                    for d, v in peer.DTYPES.items()}
    assert _enum(h, "A2AAlgo") == {"k" + k.capitalize(): v for k, v in peer_alltoall.ALGORITHMS.items()}
    # the one-shot regions fit the header's flag slots
    assert peer.ONE_SHOT_MAX_BLOCKS <= peer.MAX_BLOCKS and _const(h, "kFlagsBytes") <= peer.HEADER_BYTES


def test_peer_kernels_are_registry_algorithms():
    import torch

    for name in ("one_shot", "two_shot"):
        algo = get_class(name)(None, 2, 1.0)   # the API builds them from the group's resources
        assert algo.name == name and algo.window == 2 and not implements(name, "reduce_scatter")
        with pytest.raises(ValueError, match="CUDA"):
            algo.all_reduce(torch.ones(4), "sum", None)
        # fits: what resolve checks before auto may pick them
        assert get_class(name).fits("cuda", 2, dtype=torch.float32, gpus=2) == (torch.version.cuda is not None)
        assert not get_class(name).fits("cuda", 2, dtype=torch.float64)
        assert not get_class(name).fits("cuda", 4, gpus=2) and not get_class(name).fits("cpu", 2)


def test_resolve_falls_back_to_native_where_the_pick_does_not_fit():
    import torch

    assert hc.resolve("all_reduce", 8, 2, "cuda")[0] == "one_shot"               # the table alone
    assert hc.resolve("all_reduce", 8, 2, "cuda", gpus=1)[0] == "native"         # fewer GPUs than ranks
    assert hc.resolve("all_reduce", 8, 2, "cuda", dtype=torch.float64)[0] == "native"
    assert hc.resolve("all_to_all", 8, 2, "cuda", gpus=1)[0] == "native"
    assert hc.resolve("all_reduce", 8, 4, "cpu", dtype=torch.float64, gpus=0) == tuning.select("all_reduce", 8, 4,
                                                                                               "cpu")
