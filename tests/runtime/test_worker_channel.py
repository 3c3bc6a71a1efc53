"""WorkerGroup's typed, versioned channel (hpdl.runtime.channel) and its per-rank services: version or type
mismatches fail at once naming both sides, a rank dying mid-exchange is named and nothing hangs."""
import pytest
import torch
import torch.distributed as dist

import hpdl.runtime.channel as ch
from hpdl.runtime import ProtocolError, WorkerFailedError, WorkerGroup

import _channel_cases as C
import _rt_cases as R


def test_frames_are_checked_before_anything_is_unpickled():
    msg = ch.Result(4, 1, {"x": [1, 2]})
    assert ch.decode(ch.encode(msg), "rank 1") == msg
    with pytest.raises(ProtocolError, match=r"rank 3 speaks hpdl channel protocol 9, this process protocol "
                                            rf"{ch.PROTOCOL_VERSION} \(hpdl "):
        ch.decode(ch.encode_frame("Result", (4, 1, None), version=9), "rank 3")
    # a payload no one could unpickle is never read: the type is refused from the header alone
    forged = ch.encode_frame("Bogus", ()) + b"not a pickle"
    with pytest.raises(ProtocolError, match=r"rank 3 sent an unknown message type 'Bogus' \(channel protocol "
                                            rf"{ch.PROTOCOL_VERSION}\); known: \['Call', "):
        ch.decode(forged, "rank 3")
    with pytest.raises(ProtocolError, match="not an hpdl channel frame"):
        ch.decode(b"\x80\x04junk", "the parent")
    with pytest.raises(TypeError, match="msg must be one of the channel's messages"):
        ch.encode(("Result", 4))


@pytest.mark.timeout(120)
def test_a_rank_speaking_another_protocol_fails_the_call_at_once():
    with WorkerGroup(1, timeout=60) as g:
        procs = list(g._procs)
        with pytest.raises(ProtocolError, match=r"rank 0 speaks hpdl channel protocol 99, this process protocol "
                                                rf"{ch.PROTOCOL_VERSION}"):
            g.run(C.speak_protocol, 99)
        assert g.broken and not any(p.is_alive() for p in procs)


@pytest.mark.timeout(120)
def test_this_side_speaking_another_protocol_or_an_unknown_type_is_refused_by_the_ranks(monkeypatch):
    with WorkerGroup(2, timeout=60) as g:
        # an unknown type reaching rank 1: it says so and ends; the next call names it (no collective: rank 0
        # answers, so rank 1's words are the only failure)
        g._eps[1].send_frame(ch.encode_frame("Bogus", ()))
        with pytest.raises(WorkerFailedError, match=r"rank 1 failed[\s\S]*rank 1 cannot read the parent's message: "
                                                    r"the parent sent an unknown message type 'Bogus'"):
            g.run(R.raise_on_rank, -1, timeout=60)
        assert g.broken
    with WorkerGroup(1, timeout=60) as g:
        theirs = ch.PROTOCOL_VERSION
        monkeypatch.setattr(ch, "PROTOCOL_VERSION", 7)
        # the rank refuses the task; its answer (its protocol) is refused here, naming both versions
        with pytest.raises(ProtocolError, match=rf"rank 0 speaks hpdl channel protocol {theirs}, this process "
                                                r"protocol 7"):
            g.run(R.raise_on_rank, -1, timeout=60)
        assert g.broken


@pytest.mark.timeout(120)
def test_a_service_keeps_its_state_between_messages_and_a_failing_one_is_named(tmp_path):
    with WorkerGroup(2, timeout=60) as g:
        svc = g.start_service(C.Counter, 10)
        svc.wait_started()
        first = svc.request(1)
        assert [(r, t) for r, _, t in first] == [(0, 11), (1, 11)]
        svc.post(5)   # one-way
        again = svc.request(1)
        assert [t for *_, t in again] == [17, 17] and [p for _, p, _ in again] == [p for _, p, _ in first]
        with pytest.raises(RuntimeError, match="the service Counter is running"):
            g.start_service(C.Counter, 0)
        svc.post(("closed-file", str(tmp_path / "closed")))
        svc.stop()
        assert [(tmp_path / f"closed.{r}").read_text() for r in range(2)] == ["17", "17"]
        assert [p for p, *_ in g.run(R.pid_and_sum, 1)] == [p for _, p, _ in first]   # the ranks live on

        svc = g.start_service(C.Counter, 0)
        with pytest.raises(WorkerFailedError, match=r"rank 1 failed \(failed ranks: \[1\]\):\n[\s\S]*ValueError: "
                                                    r"bad payload on rank 1"):
            svc.request(("raise", 1))
        assert g.broken   # a service that raised ends its rank: the group cannot be trusted
        for p in g._procs:
            p.join(30)
        assert not any(p.is_alive() for p in g._procs)


@pytest.mark.timeout(120)
def test_a_rank_dying_mid_exchange_is_named_and_nothing_hangs():
    with WorkerGroup(2, timeout=600) as g:   # a long collective timeout: only the sentinel can end this early
        svc = g.start_service(C.Counter, 0)
        with pytest.raises(WorkerFailedError, match=r"rank 1 failed \(failed ranks: \[1\]\):\nrank 1 died: exited "
                                                    r"with code 3"):
            svc.request(("exit", 1))
        assert g.broken
    with WorkerGroup(2, timeout=600) as g:
        svc = g.start_service(C.Counter, 0)
        svc.post(("exit", 0))   # one-way: the death is found by the next message, or by failure()
        err = svc.failure(wait=60)
        assert isinstance(err, WorkerFailedError) and "rank 0 died: exited with code 3" in str(err)
        with pytest.raises(WorkerFailedError, match=r"rank 0 failed \(failed ranks: \[0\]\) since the last message"):
            svc.post(1)
        assert g.broken and not any(p.is_alive() for p in g._procs)


@pytest.mark.timeout(120)
def test_driver_mode_makes_this_process_rank_0_and_close_destroys_its_group():
    assert not dist.is_initialized()
    with WorkerGroup(2, timeout=60, driver=True) as g:
        assert g.ranks == [1] and g.context.rank == 0 and dist.get_world_size() == 2
        svc = g.start_service(C.SumWithDriver)
        svc.wait_started()
        for value in (1.0, 2.0):
            svc.post(value)   # the rank joins this process's all-reduce
            t = torch.tensor([10.0])
            dist.all_reduce(t)
            assert t.item() == 10.0 + value
        with pytest.raises(RuntimeError, match="already initialised here"):
            WorkerGroup(2, driver=True)
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_ctrl_c_while_waiting_on_a_service_tears_everything_down(tmp_path):
    """Serve's TP shape (this process rank 0) interrupted while its ranks are busy: KeyboardInterrupt reaches the
    caller, the ranks are killed and this process's group is destroyed (a later engine can start)."""
    import multiprocessing as mp
    import os
    import signal
    import threading
    import time

    ready = tmp_path / "ready"

    def interrupt():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        g = WorkerGroup(2, timeout=60, driver=True)
        procs = list(g._procs)
        svc = g.start_service(C.Sleeper, str(ready))
        svc.wait_started()
        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            svc.request(None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert g.broken and not any(p.is_alive() for p in procs) and not set(mp.active_children()) & set(procs)
    assert not dist.is_initialized()
