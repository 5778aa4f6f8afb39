"""`python -m control.supervise [--restarts N] -- COMMAND...`: rerun a crashed cluster from its newest checkpoint.

COMMAND starts the cluster, e.g. `mpirun -n 5 python -m master --config run.toml`
or `python -m deploy.launch -n 5 -- --config run.toml`.  When it exits with a
crash (any code but 0, and but 2, which is a user mistake the master has
already explained), it is started again with `--recover` appended: the master
resumes from the newest complete checkpoint and removes the output written
after it (BiStream, section 3.5), so after any number of crashes the results
are those of an uninterrupted run.  A Ctrl-C reaches the cluster itself and
ends the supervision instead of causing a restart.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

USER_ERROR = 2  #: the master's exit code for a configuration or input mistake: restarting cannot help


def supervise(command: list[str], restarts: int, backoff: float, log=print) -> int:
    interrupted = False

    def on_signal(signum, frame):
        nonlocal interrupted
        interrupted = True

    before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(command, restarts, backoff, log, lambda: interrupted)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _run(command: list[str], restarts: int, backoff: float, log, interrupted) -> int:
    attempt = 0
    while True:
        cmd = command if attempt == 0 or "--recover" in command else [*command, "--recover"]
        code = subprocess.call(cmd)
        if code == 0 or code == USER_ERROR or interrupted():
            return code
        if attempt >= restarts:
            log(f"supervise: the cluster crashed (exit code {code}) and all {restarts} restarts are used: giving up")
            return code
        attempt += 1
        log(f"supervise: the cluster crashed (exit code {code}); restart {attempt} of {restarts} "
            "from the newest complete checkpoint")
        time.sleep(backoff)


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
