"""``hpdl offload``: run a progress agent (``agent``) and the application comparison (``jacobi``)."""

from __future__ import annotations

import argparse
import os
import tempfile

from hpdl.runtime.commands import CommandGroup
from hpdl.runtime.errors import CLIUsageError
from hpdl.runtime.limits import count, real


class OffloadCommand(CommandGroup):
    """`hpdl offload {agent,jacobi}`."""

    dest, subcommands = "offload_cmd", ("agent", "jacobi")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        sub = cls.subparsers(parser)
        a = sub.add_parser("agent", help="run this node's progress agent until stopped (one per node)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           description="Run a progress agent. One per node: under srun/mpirun with one task per "
                                       "node the index and count come from the launcher. Ranks reach it through "
                                       "HPDL_OFFLOAD_AGENT=<address>.")
        a.add_argument("--agents", type=count(1, 4096), default=None, help="number of agents (nodes); default: the "
                       "launcher's task count, else 1")
        a.add_argument("--index", type=count(0, 4095), default=None, help="this agent's index; default: the launcher's rank")
        a.add_argument("--rendezvous", default=None, help="HOST:PORT where agent 0 listens for the others "
                       "(needed with more than one agent)")
        a.add_argument("--address", default=None, help="Unix socket path ranks connect to (default "
                       "HPDL_OFFLOAD_AGENT, else $TMPDIR/hpdl-offload-agent-<uid>[-<job id>].sock)")
        a.add_argument("--threads", type=count(1, 1024), default=1,
                       help="copy threads: the cores it may use (copies >= 64 KiB run on them in parallel)")
        a.add_argument("--timeout", type=real(0, 7 * 86400, strict=True), default=300.0, help="seconds for the rendezvous and transfers")
        a.add_argument("--spin-us", type=real(0, 1e7), default=None, help="poll this long after activity before "
                       "sleeping on the doorbell (default HPDL_OFFLOAD_SPIN_US)")
        a.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
        from hpdl.offload.jacobi import JacobiCommand

        jacobi_help = "application comparison: 3-D Jacobi step time with offloaded vs blocking halo exchange " \
                      "(also `hpdl bench jacobi`)"
        JacobiCommand.add_arguments(sub.add_parser("jacobi", help=jacobi_help, description=jacobi_help))

    @staticmethod
    def _agent(args) -> int:
        return _agent(args)

    @staticmethod
    def _jacobi(args) -> int:
        from hpdl.offload.jacobi import JacobiCommand

        return JacobiCommand().run(args)


def default_address() -> str:
    """$TMPDIR/hpdl-offload-agent-<uid>[-<job id>].sock: two users' or two batch jobs' agents on one host do
    not share a path (and an agent refuses a path another live agent serves)."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("PBS_JOBID") or os.environ.get("LSB_JOBID")
    return os.path.join(tempfile.gettempdir(), f"hpdl-offload-agent-{os.getuid()}{'-' + job if job else ''}.sock")


def _agent(args) -> int:
    from hpdl.offload.agent import AUTHKEY_ENV, run_agent
    from hpdl.runtime import env
    from hpdl.runtime.launch import detect_launcher, free_port

    found = detect_launcher()
    agents = args.agents if args.agents is not None else (found[2] if found else 1)
    index = args.index if args.index is not None else (found[1] if found else 0)
    if agents < 1 or not 0 <= index < agents:
        raise CLIUsageError(f"--index must be in [0, --agents), got index {index} of {agents}")
    rendezvous = args.rendezvous
    if rendezvous is None:
        if agents > 1:
            raise CLIUsageError("--rendezvous HOST:PORT is needed with more than one agent")
        rendezvous = f"127.0.0.1:{free_port()}"
    address = args.address or env.get("HPDL_OFFLOAD_AGENT") or default_address()
    if args.threads < 1:
        raise CLIUsageError(f"--threads must be >= 1, got {args.threads}")
    key = os.environ.pop(AUTHKEY_ENV, "")
    spin = float(env.get("HPDL_OFFLOAD_SPIN_US") if args.spin_us is None else args.spin_us)

    def ready(who: str) -> None:
        if args.parent_pid is None:
            print(f"{who} ready: export HPDL_OFFLOAD_AGENT={address}", flush=True)

    return run_agent(index=index, agents=agents, rendezvous=rendezvous, address=address,
                     authkey=bytes.fromhex(key) if key else None, threads=args.threads, timeout=args.timeout,
                     spin_us=spin, parent_pid=args.parent_pid, on_ready=ready)
