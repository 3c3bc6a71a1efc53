"""GlooTransport (hpdl.comm.transport.gloo): the private Gloo group hpdl.offload moves messages with, as a
Transport. Two ranks run as two threads of this process on one HashStore (Gloo connects them over loopback):
the Transport conformance cases (_transport_cases.py), then its own hooks, deadline and argument checks. The
same cases also run over TorchTransport on a torch.distributed gloo world (hpdl.testing's rank pool)."""

import threading

import pytest
import torch
import torch.distributed as dist

import _transport_cases
from _transport_cases import CASES
from hpdl.comm.transport.base import Transport
from hpdl.comm.transport.gloo import TRANSFER_WAIT_S, GlooTransport
from hpdl.comm.transport.sub import SubTransport
from hpdl.runtime.errors import CollectiveTimeoutError
from hpdl.testing import get_pool


def on_both(fn) -> list:
    """``fn(rank)`` for ranks 0 and 1 on two threads at once; returns both results (re-raises an exception)."""
    res, errs = [None, None], []

    def run(r):
        try:
            res[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errs.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank's thread did not finish"
    if errs:
        raise errs[0]
    return res


def pair(**kwargs) -> list[GlooTransport]:
    """Two connected transports (creation is collective: both ranks at once)."""
    store = dist.HashStore()
    return on_both(lambda r: GlooTransport.create(store, r, 2, 30.0, **kwargs))


@pytest.mark.parametrize("name", sorted(CASES))
def test_conformance(name):
    ts = pair()
    on_both(lambda r: CASES[name](ts[r]))


def test_the_cases_pass_on_a_sub_transport_view_that_swaps_the_ranks_and_it_forwards_the_hooks():
    ts = pair(prefix="sub", describe=lambda e: f"agent {e}", explain=lambda e: f"rank {e} died")
    subs = [SubTransport(t, [1, 0], tag_offset=100) for t in ts]
    assert [s.rank for s in subs] == [1, 0]
    assert (subs[0].describe(0), subs[0].explain(1)) == ("agent 1", "rank 0 died")
    for name in sorted(CASES):
        on_both(lambda r: CASES[name](subs[r]))


def test_defaults():
    ts = pair()
    assert isinstance(ts[0], Transport) and ts[0].timeout == TRANSFER_WAIT_S
    assert [(t.rank, t.world_size, t.device.type) for t in ts] == [(0, 2, "cpu"), (1, 2, "cpu")]


def test_a_wait_past_its_deadline_names_the_peer_as_described():
    ts = pair(prefix="late", transfer_timeout=1.0, describe=lambda e: f"agent {e} (pid 42) on node-b")
    req = ts[0].irecv(torch.empty(2), 1, 77)   # rank 1 never sends
    with pytest.raises(CollectiveTimeoutError, match=r"rank 0 waited 1s for the recv from agent 1 \(pid 42\) on "
                                                     r"node-b, which did not answer") as info:
        req.wait()
    assert info.value.missing_ranks == [1]


def test_describe_and_explain_hooks_and_their_defaults():
    plain = pair(prefix="plain")[0]
    assert plain.describe(1) == "rank 1" and plain.explain(1) is None

    def gone(e):
        raise RuntimeError("the store went with the agent")

    said = pair(prefix="said", explain=lambda e: f"rank {e} (pid 7) died")[0]
    assert said.explain(1) == "rank 1 (pid 7) died"
    assert pair(prefix="gone", explain=gone)[0].explain(1) is None   # no explanation, not an error


def test_bad_arguments_are_named():
    t = pair(prefix="bad")[0]
    with pytest.raises(ValueError, match=r"send peer must be another rank than this one \(0\) in \[0, 2\), got 2"):
        t.isend(torch.zeros(2), 2, 0)
    with pytest.raises(ValueError, match="recv peer must be another rank"):
        t.irecv(torch.zeros(2), 0, 0)   # itself
    with pytest.raises(ValueError, match="must be a contiguous CPU tensor .* got a meta tensor"):
        t.post([(torch.empty(2, device="meta"), 1)], [])
    with pytest.raises(ValueError, match="non-contiguous"):
        t.post([], [(torch.zeros(3, 3).t(), 1)])
    with pytest.raises(ValueError, match=r"tag must be in \[0, 2147483647\], got -1"):
        t.isend(torch.zeros(2), 1, -1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, size=2\), got 2"):
        GlooTransport.create(dist.HashStore(), 2, 2, 1.0)
    with pytest.raises(TypeError, match=r"send tensor must be a torch.Tensor, got str"):
        t.isend("abc", 1, 0)
    with pytest.raises(TypeError, match=r"tag must be an int \(in \[0, 2147483647\]\), got 1.5 \(float\)"):
        t.irecv(torch.zeros(2), 1, 1.5)


@pytest.mark.parametrize("timeout, exc, msg", [(-1, ValueError, r"timeout must be a finite number of seconds > 0, "
                                                                r"got -1.0"),
                                               (0, ValueError, "got 0.0"), (float("inf"), ValueError, "got inf"),
                                               (float("nan"), ValueError, "got nan"),
                                               ("5", TypeError, r"timeout must be a number of seconds > 0, got '5'")])
def test_a_bad_timeout_is_named(timeout, exc, msg):
    with pytest.raises(exc, match=msg):
        GlooTransport.create(dist.HashStore(), 0, 1, 5.0, transfer_timeout=timeout)


@pytest.mark.timeout(120)
def test_the_cases_pass_on_torch_transport_over_a_gloo_world():
    for rank, res in enumerate(get_pool(2).run(_transport_cases.on_torch_transport)):
        assert set(res) == set(CASES)
        for name, verdict in res.items():
            assert verdict == "ok", f"rank {rank}, case {name}:\n{verdict}"
