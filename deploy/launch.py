"""`python -m deploy.launch -n 17 [--hostfile hosts] -- [master args]`: start the cluster with the venv's mpirun.

Open MPI from PyPI ships `mpirun` next to the venv's python.  It refuses to run
as root and to start more ranks than cores unless told; a stream join with 17
ranks on a laptop is the normal case here, so both are allowed, and idle ranks
yield the core (they also back off in `protocol.mpi.wait_probe`).

With a hostfile the launcher places the ranks itself (deploy.hosts): Open MPI 5
given `--oversubscribe` puts every rank on the first host whatever the hostfile
says.  Ranks are never bound to cores: with more ranks than cores (the normal
case here) and each rank's helper threads (file writer, reader, heartbeats), a
binding makes them queue for one core while another idles.

Stopping and the exit code are deploy.job's: the first Ctrl-C (or SIGTERM, or
SIGUSR1) is the clean stop, a second aborts, an abort that mpirun does not
complete (a host cut off) is completed here, and Open MPI's own exit codes are
mapped to the documented ones.  With a bare mpirun, `kill -USR1 <mpirun pid>`
is the clean stop.  Arguments, the configuration and the hostfile are checked
before mpirun starts (exit 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import atexit
import contextlib
import ipaddress
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy.hosts import HostfileError, describe, place, read_hostfile, write_placement
from deploy.job import run_job
from deploy.kernels import AHEAD
from master.cli import checked_plan
from protocol.compiled import kernel_sources
from protocol.config import ConfigError
from protocol.lifetime import USER_ERROR, invocation
from protocol.startup import BTL, LAUNCHED, PLACED_HOSTS

if TYPE_CHECKING:
    from protocol.plan import Cluster

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "PYTHONUNBUFFERED": "1",
    # one thread per rank for numpy's BLAS: its idle threads spin after a call, on cores the other ranks need
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}


def find_mpirun() -> str:
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if not found:
        raise SystemExit("error: mpirun not found; run `make setup` (installs Open MPI from PyPI into .venv)")
    return found


#: the modules with compiled kernels: those built ahead of time, and text keys' coding, compiled by numba and
#: cached (slave.kernel last: the note of the build is kept beside it)
KERNEL_MODULES = ("master.sources.key_codes", *AHEAD)


def kernel_stamp(modules: tuple[str, ...] = KERNEL_MODULES) -> tuple[Path, str]:
    """Where the note of built kernels is kept (in slave/__pycache__, beside the builds and numba's cache files:
    removing the caches removes it) and what it must say: the size and modification time of each kernel module
    and of the project's modules it imports from (protocol.compiled.kernel_sources), numba's and Python's
    versions and NUMBA_CACHE_DIR."""
    from importlib.metadata import version
    from importlib.util import find_spec

    kernel_files = [Path(find_spec(name).origin) for name in modules]
    files = list(dict.fromkeys(f for k in kernel_files for f in kernel_sources(k)))
    state = json.dumps(
        [
            version("numba"),
            sys.version,
            os.environ.get("NUMBA_CACHE_DIR"),
            *((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files),
        ]
    )
    return kernel_files[-1].parent / "__pycache__" / "streamjoin-kernels-warm.json", state


def warm_kernels() -> None:
    """Build the kernels ahead of time (deploy.kernels, about 15 s) once, if a kernel module changed since the
    last build (or this is a fresh checkout): otherwise every rank would compile them with numba at start, about
    10 s of CPU each (16 slaves on 2 cores: minutes).  The note of the last build makes a launch with nothing
    changed skip it."""
    stamp, state = kernel_stamp()
    with contextlib.suppress(OSError):
        if stamp.read_text() == state:
            return
    subprocess.run([sys.executable, "-m", "deploy.kernels"], cwd=Path(__file__).resolve().parent.parent, check=True)
    with contextlib.suppress(OSError):  # a read-only checkout builds (or compiles) each time
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(state)


def mpirun_command(
    ranks: int,
    args: list[str],
    hostfile: str | None = None,
    module: str = "master",
    cluster: Cluster | None = None,
    log=print,
) -> list[str]:
    """The mpirun command line.  With a hostfile the ranks go where `deploy.hosts.place` puts them (said in one
    line through `log`), and every rank gets this launcher's environment; `cluster`: the plan's [cluster]
    (heartbeat timeout, network, ports), which sets Open MPI's network and keepalive (`network_options`).  Ranks
    start with `python -P`: the working folder is not on their path, so a user's `common.py` there cannot hide ours."""
    warm_kernels()
    cmd = [find_mpirun(), "--bind-to", "none", *network_options(cluster)]
    if not hostfile:
        return cmd + ["--oversubscribe", "-n", str(ranks), sys.executable, "-P", "-m", module, *args]
    placement = place(read_hostfile(hostfile), ranks)
    log(describe(placement))
    placed = write_placement(placement, Path(session_root()) / "hostfile")
    forwarded = [name for name in os.environ if name.startswith(("STREAMJOIN_", "OMPI_MCA_"))]
    cmd += [
        "--hostfile",
        str(placed),
        "--map-by",
        "slot",
        "-n",
        str(ranks),
        "-x",
        f"{PLACED_HOSTS}={len(placement)}",
        *[
            x
            for name in dict.fromkeys([*MPI_ENV, "OMPI_MCA_btl", "PYTHONPATH", LAUNCHED, *forwarded])
            for x in ("-x", name)
        ],
    ]
    return cmd + [sys.executable, "-P", "-m", module, *args]


def network_options(cluster: Cluster | None) -> list[str]:
    """Open MPI's daemons keep their connections alive with TCP keepalives tuned to the heartbeat timeout (a
    daemon cut off from mpirun then ends, and its ranks with it, instead of waiting for its link for minutes:
    Open MPI's default is 300 s + 9 x 20 s); `cluster.network` limits Open MPI's traffic, the ranks' (btl)
    and the daemons' (oob), to one address range (IPv4 only when the range is IPv4); `cluster.ports` the ports
    they listen on (Open MPI listens on every address whatever the range: a firewall decides who reaches
    them)."""
    timeout = cluster.heartbeat_timeout if cluster else 5.0
    # idle for the timeout + 2 s, then 3 probes 1 s apart: the engine's own detector, which names the rank and
    # what it last said, speaks first (protocol.liveness)
    opts = [
        "--prtemca",
        "oob_tcp_keepalive_time",
        str(math.ceil(timeout) + 2),
        "--prtemca",
        "oob_tcp_keepalive_intvl",
        "1",
        "--prtemca",
        "oob_tcp_keepalive_probes",
        "3",
    ]
    network, ports = (cluster.network, cluster.ports) if cluster else ("", "")
    if network:
        opts += ["--mca", "btl_tcp_if_include", network, "--prtemca", "oob_tcp_if_include", network]
        if ipaddress.ip_network(network, strict=False).version == 4:
            opts += ["--mca", "btl_tcp_disable_family", "6", "--prtemca", "oob_tcp_disable_ipv6_family", "1"]
    if ports:  # the ranks' listeners from the first half, the daemons' from the second
        low, high = map(int, ports.split("-"))
        middle = (low + high + 1) // 2
        for v in ("4", "6"):
            opts += [
                "--mca",
                f"btl_tcp_port_min_v{v}",
                str(low),
                "--mca",
                f"btl_tcp_port_range_v{v}",
                str(middle - low),
                "--prtemca",
                f"oob_tcp_dynamic_ipv{v}_ports",
                f"{middle}-{high}",
            ]
    return opts


_session_files: str | None = None


def session_root() -> str:
    """This launch's folder for mpirun's session files and the placed hostfile, removed when this process
    exits."""
    global _session_files
    if _session_files is None:
        _session_files = tempfile.mkdtemp(prefix="streamjoin-mpi.")
        atexit.register(shutil.rmtree, _session_files, True)
    return _session_files


def session_tmpdir() -> str:
    """A fresh folder for one mpirun's session files (its TMPDIR).

    Open MPI keeps its PMIx rendezvous sockets in `$TMPDIR/ompi.<mpirun pid>/`; an mpirun that is killed leaves
    them behind, and a later mpirun that gets the same pid (pids wrap at 32768 on many machines) cannot bind
    them: "The PMIx server's listener thread failed to start", exit 213, before any rank runs.  One folder per
    launch, made here, cannot hold another run's leftovers."""
    return tempfile.mkdtemp(dir=session_root())


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(MPI_ENV)
    env.setdefault("OMPI_MCA_btl", BTL)
    env["TMPDIR"] = session_tmpdir()
    env[LAUNCHED] = repr(time.time())  # the summary's start-up times count from here (protocol.startup)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=invocation("deploy.launch"), description=__doc__.split("\n")[0])
    p.add_argument("-n", "--ranks", type=int, default=17, help="ranks in all: 1 master + slaves (default 17)")
    p.add_argument("--hostfile", help="Open MPI hostfile for several hosts (see hosts.example, docs/operating.md)")
    p.add_argument("--module", default="master", help="python module every rank runs (default master)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then arguments for python -m master")
    a = p.parse_args(argv)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    cluster = None
    try:
        if a.module == "master":  # a mistake is told once, before mpirun starts a rank (exit 2 on a bad argument)
            cluster = checked_plan(rest, a.ranks - 1).cluster
        cmd = mpirun_command(
            a.ranks, rest, a.hostfile, a.module, cluster, log=lambda line: print(line, file=sys.stderr, flush=True)
        )
    except (ConfigError, HostfileError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR
    return run_job(cmd, mpi_env())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
