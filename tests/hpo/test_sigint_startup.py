"""Issue 37: Ctrl-C (SIGINT to the process group) at any moment of `hpdl hpo run`'s start-up ends within 5 s
with exit 130 and one line, and the command that line names finishes the budget with one trial per
configuration. A few moments here (CI); `benchmarks/hpo_sigint_sweep.py` runs the full 0.5 s x 16 sweep."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "hpo_sigint_sweep.py"
_spec = importlib.util.spec_from_file_location("hpo_sigint_sweep", _PATH)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("delay_s", [0.2, 1.5, 4.0])
def test_sigint_to_the_process_group_during_start_up(tmp_path, delay_s):
    # 0.2 s: interpreter and imports; 1.5 s: torch import, forkserver start; 4 s: study, pool or first trials
    # (how far it got depends on the machine's load: each moment must hold whatever it hits)
    # the exit-time bound here is loose (a loaded CI host); the 5 s goal is what the sweep script measures
    row = sweep.interrupt_once(delay_s, tmp_path, sweep.study_file(tmp_path, tiny=True), exit_limit_s=30.0)
    assert row["ok"], row
