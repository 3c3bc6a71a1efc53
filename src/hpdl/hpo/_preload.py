"""Imported once by the forkserver that starts local trial workers (:func:`hpdl.hpo.launch.worker_context`).

Every worker forks from that server with these modules already loaded instead of importing them itself:
torch (3-5 s), ``torch._dynamo`` (3-6 s; the first optimizer a process builds imports it), optuna and the
SQL storage's sqlalchemy and alembic (about 1 s). Nothing here touches a GPU or starts a thread: CUDA
must be initialised only in the forked workers.
"""

from __future__ import annotations

import contextlib

import optuna  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401

import hpdl.hpo.profiler  # noqa: F401
import hpdl.hpo.spec  # noqa: F401
import hpdl.hpo.worker  # noqa: F401
import hpdl.hpo.workloads  # noqa: F401

with contextlib.suppress(ImportError):  # optuna's RDB storage imports these on first use
    import alembic.migration  # noqa: F401
    import sqlalchemy  # noqa: F401
