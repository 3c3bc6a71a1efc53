"""Live terminal view of a running study (rich): trials per device, memory and compute load, best value."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from hpdl.hpo.policies import GIB


class Progress:
    """Refreshes at most 4 times a second from the driver's state; ``close`` restores the terminal."""

    def __init__(self, driver):
        self.d = driver
        self._last = 0.0
        self.live = Live(self._table(), console=Console(stderr=True), refresh_per_second=4, transient=False)
        self.live.start()

    def _table(self) -> Table:
        d = self.d
        finished, _ = d.ledger.lineages()
        best = d.best_so_far()
        title = (f"{d.spec.study} [{d.policy.name}]  finished {len(finished)}/{d.spec.n_trials}  "
                 f"queued {len(d.pending)}  best {best if best is None else f'{best:.4g}'}  "
                 f"{time.monotonic() - d._t0:.0f} s")
        table = Table(title=title)
        for col in ("device", "kind", "trials", "memory GiB", "compute"):
            table.add_column(col)
        for st in d._device_states(d.pool.devices()):
            trials = [t for t in st.running if t.key >= 0]
            table.add_row(st.device.id, st.device.kind, " ".join(str(t.key) for t in trials) or "-",
                          f"{st.memory_used / GIB:.1f}/{st.device.memory_bytes / GIB:.0f}",
                          f"{st.compute_used:.2f}")
        return table

    def update(self, force: bool = False) -> None:
        """Redraw (at most 4 times a second unless ``force``: the last frame must show the final state)."""
        now = time.monotonic()
        if force or now - self._last >= 0.25:
            self._last = now
            self.live.update(self._table())

    def close(self) -> None:
        self.live.stop()
        if not self.live.console.is_terminal:  # a file or pipe: end the table's last line before the summary
            self.live.console.print()
