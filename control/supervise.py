"""`python -m control.supervise [--restarts N] -- COMMAND...`: rerun a crashed cluster from its newest checkpoint.

COMMAND starts the cluster, e.g. `mpirun -n 5 python -m master --config run.toml`
or `python -m deploy.launch -n 5 -- --config run.toml`.  When it exits with a
crash (any code but 0, and but 2, which is a user mistake the master has
already explained), it is started again with `--recover` appended: the master
resumes from the newest complete checkpoint and removes the output written
after it (BiStream, section 3.5), so after any number of crashes the results
are those of an uninterrupted run.  SIGINT or SIGTERM to the supervisor (a
Ctrl-C, docker stop, Kubernetes) is passed to the cluster as its clean stop
(SIGUSR1): the supervisor exits with the cluster's code once it has stopped, and
does not restart it; a second signal aborts the cluster, a third kills it.  If
the supervisor is killed, the cluster dies with it.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

from protocol.lifetime import USER_ERROR, die_with_parent, exit_code

#: what the n-th stop signal to the supervisor sends the cluster: SIGUSR1 is the clean stop of both mpirun
#: (it forwards it to every rank) and deploy.launch; then SIGTERM (mpirun and the launcher abort the job)
FORWARD = (signal.SIGUSR1, signal.SIGTERM, signal.SIGKILL)


def supervise(command: list[str], restarts: int, backoff: float, log=print) -> int:
    cluster: list[subprocess.Popen] = []  #: the running one
    stops = 0

    def on_signal(signum, frame):
        nonlocal stops
        stops += 1
        if cluster and cluster[-1].poll() is None:
            cluster[-1].send_signal(FORWARD[min(stops, len(FORWARD)) - 1])

    before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(command, restarts, backoff, log, cluster, lambda: stops > 0)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _run(command: list[str], restarts: int, backoff: float, log, cluster: list, stopped) -> int:
    """The cluster runs in its own session, so a Ctrl-C at the terminal reaches it once, through `on_signal`,
    and dies with the supervisor (protocol.lifetime); a restart after a crash waits for the crashed run's hold
    on the output folder to end (master.lock), so two clusters never write it at once."""
    attempt = code = 0
    while not stopped():
        cmd = command if attempt == 0 or "--recover" in command else [*command, "--recover"]
        cluster.append(subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent))
        code = exit_code(cluster[-1].wait())
        if code == 0 or code == USER_ERROR or stopped():
            return code
        if attempt >= restarts:
            log(f"supervise: the cluster crashed (exit code {code}) and all {restarts} restarts are used: giving up")
            return code
        attempt += 1
        log(f"supervise: the cluster crashed (exit code {code}); restart {attempt} of {restarts} "
            "from the newest complete checkpoint")
        time.sleep(backoff)
    return code  # stopped while waiting to restart: the crash's code


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m control.supervise", description=__doc__.split("\n")[0])
    p.add_argument("--restarts", type=int, default=10, help="restarts before giving up (default 10)")
    p.add_argument("--backoff", type=float, default=1.0, help="seconds to wait before a restart (default 1)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command that runs the cluster")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give the cluster's command after --, e.g. -- mpirun -n 5 python -m master --config run.toml")
    return supervise(command, a.restarts, a.backoff, log=lambda m: print(m, file=sys.stderr, flush=True))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
