"""Imported once by the forkserver that starts local trial workers (:func:`hpdl.hpo.launch.worker_context`).

Every worker forks from that server with these modules already loaded instead of importing them itself:
torch (3-5 s), ``torch._dynamo`` (3-6 s; the first optimizer a process builds imports it), optuna and the
SQL storage's sqlalchemy and alembic (about 1 s). Nothing here touches a GPU or starts a thread: CUDA
must be initialised only in the forked workers.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import warnings

# Ctrl-C reaches the whole process group: the server (and every worker forked from it, which inherits this)
# ignores it, the driver decides. A KeyboardInterrupt here, while torch imports, killed the server and the
# driver's next worker start failed with "EOFError: unexpected EOF".
signal.signal(signal.SIGINT, signal.SIG_IGN)

MODULES = ("torch", "torch._dynamo", "optuna", "sqlalchemy", "alembic.migration", "hpdl.hpo.profiler",
           "hpdl.hpo.spec", "hpdl.hpo.worker", "hpdl.hpo.workloads")

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception as _exc:  # noqa: BLE001 - a failed preload must not take the server down
        warnings.warn(f"hpdl.hpo forkserver: {_name} not preloaded ({_exc!r}); workers import it themselves",
                      RuntimeWarning, stacklevel=1)

# The server ends (SystemExit) when its driver is gone. A normal interpreter teardown would unload torch,
# which took 3-6 s on a loaded 2-core machine while the server still held the driver's stdout and stderr
# open (a pipe such as `hpdl hpo run ... | tee` stayed open that long after the driver exited). Nothing of
# the server needs a teardown; the workers it forks end with os._exit and never run this.
atexit.register(os._exit, 0)
