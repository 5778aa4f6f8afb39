"""`python -m deploy.launch -n 17 [--hostfile hosts] -- [master args]`: start the cluster with the venv's mpirun.

Open MPI from PyPI ships `mpirun` next to the venv's python.  It refuses to run
as root and to start more ranks than cores unless told; a stream join with 17
ranks on a laptop is the normal case here, so both are allowed, and idle ranks
yield the core (they also back off in `protocol.mpi.wait_probe`).

Stopping: Open MPI's mpirun kills the job at once on SIGINT/SIGTERM, but it
forwards SIGUSR1 to every rank.  So mpirun runs in its own session and this
launcher turns the first Ctrl-C (or SIGTERM, or SIGUSR1) into SIGUSR1: the master
stops ingesting, joins what it accepted, flushes results and writes the summary.
A second Ctrl-C aborts.  With a bare mpirun, `kill -USR1 <mpirun pid>` does the
same.  Arguments and the configuration are checked before mpirun starts; exit
codes are the master's (0 done or stopped, 2 a user mistake, else a crash).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from master.cli import checked_config
from protocol.config import ConfigError
from protocol.lifetime import USER_ERROR, die_with_parent, exit_code
from protocol.startup import LAUNCHED

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


#: the modules whose numba kernels are cached on disk (`cache=True`)
KERNEL_MODULES = ("master.ingest", "master.keys", "slave.kernel")


def kernel_stamp(modules: tuple[str, ...] = KERNEL_MODULES) -> tuple[Path, str]:
    """Where the note of a warm cache is kept (beside numba's cache files, in slave/__pycache__: removing the
    caches removes it) and what it must say: each kernel module's size and modification time (what numba's cache
    checks too), numba's and Python's versions and NUMBA_CACHE_DIR."""
    from importlib.metadata import version
    from importlib.util import find_spec

    files = [Path(find_spec(name).origin) for name in modules]
    state = json.dumps([version("numba"), sys.version, os.environ.get("NUMBA_CACHE_DIR"),
                        *((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)])
    return files[-1].parent / "__pycache__" / "streamjoin-kernels-warm.json", state


def warm_kernels() -> None:
    """Compile the slaves' join kernels (and the master's tuple packing) into numba's on-disk cache here, once,
    if it is stale (a fresh checkout or a changed slave/kernel.py): otherwise every slave rank would compile
    them at once at start, about 10 s of CPU each (16 slaves on 2 cores: minutes).  Loading a warm cache still
    costs this process about 0.9 s before mpirun may start, so a note of the modules it was warmed for skips
    it when nothing changed."""
    stamp, state = kernel_stamp()
    with contextlib.suppress(OSError):
        if stamp.read_text() == state:
            return
    import master.ingest  # noqa: F401  (compiles at import: one signature per kernel)
    import slave.kernel  # noqa: F401
    import pyarrow as pa
    from master.keys import KeyDictionary  # text keys' coding compiles at its first call: 16 values, a rehash too

    KeyDictionary(pa.string()).codes(pa.array([str(i) for i in range(16)]))
    with contextlib.suppress(OSError):  # a read-only checkout warms each time
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(state)


def mpirun_command(ranks: int, args: list[str], hostfile: str | None = None, module: str = "master") -> list[str]:
    warm_kernels()
    cmd = [find_mpirun(), "--oversubscribe", "-n", str(ranks)]
    if hostfile:  # ranks on other hosts get the same environment (the checkout is at the same path there)
        cmd += ["--hostfile", hostfile, *[x for name in (*MPI_ENV, "OMPI_MCA_btl", "PYTHONPATH") for x in ("-x", name)]]
    return cmd + [sys.executable, "-m", module, *args]


_session_files: str | None = None


def session_tmpdir() -> str:
    """A fresh folder for one mpirun's session files (its TMPDIR), removed when this process exits.

    Open MPI keeps its PMIx rendezvous sockets in `$TMPDIR/ompi.<mpirun pid>/`; an mpirun that is killed leaves
    them behind, and a later mpirun that gets the same pid (pids wrap at 32768 on many machines) cannot bind
    them: "The PMIx server's listener thread failed to start", exit 213, before any rank runs.  One folder per
    launch, made here, cannot hold another run's leftovers."""
    global _session_files
    if _session_files is None:
        _session_files = tempfile.mkdtemp(prefix="streamjoin-mpi.")
        atexit.register(shutil.rmtree, _session_files, True)
    return tempfile.mkdtemp(dir=_session_files)


#: Open MPI's byte transfer layers: loopback, shared memory, TCP between hosts.  Left to choose, it also probes
#: every other component at MPI_Init, which took 1.0 of 1.1 s of each rank's start here (0.09 s with these);
#: a value the user exported wins
BTL = "self,sm,tcp"


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
    p = argparse.ArgumentParser(prog="python -m deploy.launch", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--ranks", type=int, default=17, help="ranks in all: 1 master + slaves (default 17)")
    p.add_argument("--hostfile", help="Open MPI hostfile for several hosts (see hosts.example)")
    p.add_argument("--module", default="master", help="python module every rank runs (default master)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then arguments for python -m master")
    a = p.parse_args(argv)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    if a.module == "master":  # a mistake is told once, before mpirun starts a rank (exit 2 on a bad argument)
        try:
            checked_config(rest, a.ranks - 1)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return USER_ERROR
    return run_until_done(mpirun_command(a.ranks, rest, a.hostfile, a.module))


def run_until_done(cmd: list[str]) -> int:
    """Run mpirun; the first SIGINT/SIGTERM/SIGUSR1 becomes a clean stop (SIGUSR1), the second aborts.  mpirun
    dies with this launcher, and the ranks with mpirun (protocol.lifetime): killing the launcher leaves nothing."""
    proc = None
    signals = 0

    def on_signal(signum, frame):
        nonlocal signals
        signals += 1
        if proc is None:
            return
        if signals == 1:
            proc.send_signal(signal.SIGUSR1)
        else:
            print("second signal: aborting the job", file=sys.stderr, flush=True)
            proc.terminate()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, on_signal)
    proc = subprocess.Popen(cmd, env=mpi_env(), start_new_session=True, preexec_fn=die_with_parent)
    if signals:  # one came while mpirun started
        on_signal(None, None)
    return exit_code(proc.wait())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
