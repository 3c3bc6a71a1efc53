"""Worker side of pack's memory caps, on CPU: the allocator fraction a cap becomes, and the cap lowered to
the measured peak once a capped CUDA trial's profile is sent (``torch.cuda`` calls are recorded, not made)."""

from types import SimpleNamespace

import pytest
import torch

import hpdl.hpo.trial as trial
from hpdl.hpo.profiler import TrialProfile
from hpdl.hpo.messages import ProfileReport, Task

GIB = 1 << 30


@pytest.fixture
def fractions(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=100 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, dev: calls.append(f))
    return calls


def test_cap_becomes_the_allocator_fraction_without_the_context(fractions):
    dev = torch.device("cuda", 0)
    trial.cap_memory(dev, 10 * GIB, GIB)
    trial.cap_memory(dev, None)              # the next trial on a reused worker: no cap left over
    trial.cap_memory(dev, 200 * GIB, GIB)    # over the device: the whole device
    trial.cap_memory(dev, GIB, GIB)          # nothing left after the context: a floor, never 0
    assert fractions[:3] == [pytest.approx(0.09), 1.0, 1.0]
    assert fractions[3] == pytest.approx((64 << 20) / (100 * GIB))


class _Profiler:
    """Done after the first step, with a measured peak of 4 GiB."""

    def __init__(self):
        self.done, self.result = False, None

    def before(self, step):
        pass

    def after(self, step):
        self.done, self.result = True, TrialProfile("H200", 4 * GIB, 0.01, 0.5, source="cuda")


@pytest.mark.parametrize("device, cap, lowered", [("cuda", 6 * GIB, 4 * GIB), ("cuda", 3 * GIB, 3 * GIB),
                                                  ("cuda", None, None), ("cpu", 6 * GIB, None)])
def test_capped_cuda_trial_is_held_to_its_profile_once_measured(monkeypatch, tmp_path, device, cap, lowered):
    calls, sent = [], []
    monkeypatch.setattr(trial, "cap_memory", lambda dev, b, ctx=0: calls.append((b, ctx)))
    conn = SimpleNamespace(send=sent.append, poll=lambda: False)
    task = Task(7, 0, 0, {}, memory_cap=cap, context_bytes=GIB // 2)
    ctx = trial.TrialContext(None, {}, torch.device(device), conn, task, tmp_path, 1, _Profiler())
    with ctx.step(0):
        pass
    assert isinstance(sent[0], ProfileReport) and sent[0].trial_id == 7
    assert calls == ([] if lowered is None else [(lowered, GIB // 2)])
