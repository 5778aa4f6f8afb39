"""`python -m control.supervise [--restarts N] [--min-slaves M] -- COMMAND...`: rerun a crashed cluster from its
newest checkpoint, on the hosts that still answer.

COMMAND starts the cluster, e.g. `python -m deploy.launch -n 5 --hostfile hosts -- --config run.toml`
or `mpirun -n 5 python -m master --config run.toml`.  When it exits with a
crash (any code but 0, 2, a user mistake the master has already explained,
and 8, a Kafka stream's records deleted before they were read, which a restart
would meet again), it is started again with `--recover` appended: the master
resumes from the newest complete checkpoint and removes the output written
after it (BiStream, section 3.5), so after any number of crashes the results
are those of an uninterrupted run.  Restarts wait `--backoff` seconds, doubling
each time up to `--max-backoff` (a host that is down is not retried in a loop).

With `deploy.launch --hostfile`, every host of the hostfile is probed before a
restart the way Open MPI reaches it (its ssh agent): one that does not answer
is left out, with the ranks the launcher would have placed on it, and the run
resumes on the slaves that remain (the checkpoint's partition-groups are placed
anew, protocol.checkpoint.reassign); a host that answers again is taken back at
the next restart.  Fewer slaves than `--min-slaves` left: exit 6.  Every
restart is recorded in the run's summary.json (`restarts`).

SIGINT or SIGTERM to the supervisor (a Ctrl-C, docker stop, Kubernetes) is
passed to the cluster as its clean stop (SIGUSR1): the supervisor exits with
the cluster's code once it has stopped, and does not restart it; a second
signal aborts the cluster, a third kills it.  If the supervisor is killed, the
cluster dies with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deploy.hosts import HostfileError, answers, place, read_hostfile
from protocol.lifetime import INPUT_LOST, TOO_FEW, USER_ERROR, die_with_parent, exit_code, invocation
from protocol.startup import RESTARTS

#: what the n-th stop signal to the supervisor sends the cluster: SIGUSR1 is the clean stop of both mpirun
#: (it forwards it to every rank) and deploy.launch; then SIGTERM (mpirun and the launcher abort the job)
FORWARD = (signal.SIGUSR1, signal.SIGTERM, signal.SIGKILL)


class Hosts:
    """The hosts of a `deploy.launch --hostfile` command: which answer, and the command for those."""

    def __init__(self, command: list[str], workdir: Path):
        self.command, self.workdir = command, workdir
        self.ranks = int(_value(command, ("-n", "--ranks")) or 17)
        self.hostfile = _value(command, ("--hostfile",))
        self.hosts = read_hostfile(self.hostfile)
        self.dispatchers = _dispatchers(command)

    def for_restart(self, answering: set[str], min_slaves: int) -> tuple[list[str] | None, dict]:
        """The command on the hosts that answer, and what it uses (None when too few slaves remain): the ranks
        the full hostfile would place on a silent host are left out."""
        placed = dict((h.name, n) for h, n in place(self.hosts, self.ranks))
        up = [h for h in self.hosts if h.name in answering]
        ranks = self.ranks - sum(n for name, n in placed.items() if name not in answering)
        record = {
            "hosts": [h.name for h in up if h.name in placed],
            "left_out": sorted(name for name in placed if name not in answering),
            "slaves": ranks - self.dispatchers,
        }
        if not up or record["slaves"] < min_slaves:
            return None, record
        hostfile = self.workdir / f"hosts-{len(list(self.workdir.iterdir()))}"
        hostfile.write_text("".join(f"{h.name} slots={h.slots}\n" for h in up))
        return _replace(_replace(self.command, ("-n", "--ranks"), str(ranks)), ("--hostfile",), str(hostfile)), record


def _launcher_part(command: list[str]) -> list[str]:
    """The launcher's own arguments: up to `--` (the rest is the master's)."""
    return command[: command.index("--")] if "--" in command else command


def _value(command: list[str], names: tuple[str, ...]) -> str | None:
    own = _launcher_part(command)
    for i, word in enumerate(own):
        if word in names and i + 1 < len(own):
            return own[i + 1]
        for name in names:
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def _replace(command: list[str], names: tuple[str, ...], value: str) -> list[str]:
    out, skip = [], False
    for i, word in enumerate(command):
        if skip:
            skip = False
            continue
        if i < len(_launcher_part(command)) and word in names:
            out += [word, value]
            skip = True
        elif i < len(_launcher_part(command)) and any(word.startswith(n + "=") for n in names):
            out.append(word.split("=", 1)[0] + "=" + value)
        else:
            out.append(word)
    return out


def _dispatchers(command: list[str]) -> int:
    """cluster.dispatchers of the master's arguments (after `--`)."""
    from master.cli import parse_args
    from protocol.config import ConfigError
    from protocol.plan import load_plan

    rest = command[command.index("--") + 1 :] if "--" in command else []
    try:
        a = parse_args([w for w in rest if w != "--recover"])
        return load_plan(a.config, a.set).cluster.dispatchers
    except (ConfigError, SystemExit):
        return 1  # the cluster itself will say what is wrong


def is_hosted_launch(command: list[str]) -> bool:
    """`deploy.launch --hostfile ...`, as `python -m deploy.launch` or as `streamjoin run` (or `launch`)."""
    launch = any(w.endswith("deploy.launch") or w.endswith("deploy/launch.py") for w in command) or any(
        Path(w).name == "streamjoin" and then in ("run", "launch") for w, then in zip(command, command[1:])
    )
    return launch and _value(command, ("--hostfile",)) is not None


def supervise(
    command: list[str],
    restarts: int,
    backoff: float,
    log=print,
    min_slaves: int = 1,
    max_backoff: float = 60.0,
    sleep=time.sleep,
) -> int:
    cluster: list[subprocess.Popen] = []  #: the running one
    stops = 0

    def on_signal(signum, frame):
        nonlocal stops
        stops += 1
        if cluster and cluster[-1].poll() is None:
            cluster[-1].send_signal(FORWARD[min(stops, len(FORWARD)) - 1])

    before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    workdir = Path(tempfile.mkdtemp(prefix="streamjoin-supervise."))
    try:
        hosts = Hosts(command, workdir) if is_hosted_launch(command) else None
        return _run(command, hosts, restarts, backoff, max_backoff, min_slaves, log, cluster, lambda: stops > 0, sleep)
    except HostfileError as e:
        log(f"supervise: {e}")
        return USER_ERROR
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _run(
    command: list[str],
    hosts: Hosts | None,
    restarts: int,
    backoff: float,
    max_backoff: float,
    min_slaves: int,
    log,
    cluster: list,
    stopped,
    sleep,
) -> int:
    """The cluster runs in its own session, so a Ctrl-C at the terminal reaches it once, through `on_signal`,
    and dies with the supervisor (protocol.lifetime); a restart after a crash waits for the crashed run's hold
    on the output folder to end (master.lock), so two clusters never write it at once."""
    attempt = code = 0
    record: list[dict] = []
    cmd = command
    while not stopped():
        env = {**os.environ, RESTARTS: json.dumps(record)}
        cluster.append(subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent, env=env))
        code = exit_code(cluster[-1].wait())
        if code in (0, USER_ERROR, INPUT_LOST) or stopped():
            return code
        if attempt >= restarts:
            log(f"supervise: the cluster crashed (exit code {code}) and all {restarts} restarts are used: giving up")
            return code
        attempt += 1
        wait = min(backoff * 2 ** (attempt - 1), max_backoff)
        log(
            f"supervise: the cluster crashed (exit code {code}); restart {attempt} of {restarts} "
            f"from the newest complete checkpoint in {wait:g}s"
        )
        sleep(wait)
        cmd = command if "--recover" in command else [*command, "--recover"]
        entry = {"attempt": attempt, "after_exit_code": code, "at": round(time.time(), 3)}
        if hosts is not None:
            answering = probe(hosts.hosts, log)
            cmd, used = hosts.for_restart(answering, min_slaves)
            entry.update(used)
            if cmd is None:
                log(
                    f"supervise: {used['slaves']} slave(s) would remain on the hosts that answer "
                    f"({', '.join(used['hosts']) or 'none'}), fewer than --min-slaves {min_slaves}: giving up"
                )
                return TOO_FEW
            cmd = [*cmd, "--recover"] if "--recover" not in cmd else cmd
            log(
                f"supervise: restarting on {', '.join(used['hosts'])} with {used['slaves']} slaves"
                + (f" (left out, not answering: {', '.join(used['left_out'])})" if used["left_out"] else "")
            )
        record.append(entry)
    return code  # stopped while waiting to restart: the crash's code


def probe(hosts, log) -> set[str]:
    """The names of the hosts that answer (all probed at once)."""
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        up = dict(zip((h.name for h in hosts), pool.map(lambda h: answers(h.name), hosts)))
    for name, ok in up.items():
        if not ok:
            log(f"supervise: host {name} does not answer")
    return {name for name, ok in up.items() if ok}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=invocation("control.supervise"), description=__doc__.split("\n")[0])
    p.add_argument("--restarts", type=int, default=10, help="restarts before giving up (default 10)")
    p.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="seconds before the first restart, doubling for each next one (default 1)",
    )
    p.add_argument("--max-backoff", type=float, default=60.0, help="the longest wait before a restart (default 60)")
    p.add_argument(
        "--min-slaves",
        type=int,
        default=1,
        help="with deploy.launch --hostfile: give up (exit 6) when fewer slaves remain (default 1)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command that runs the cluster")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give the cluster's command after --, e.g. -- mpirun -n 5 python -m master --config run.toml")
    return supervise(
        command,
        a.restarts,
        a.backoff,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        min_slaves=a.min_slaves,
        max_backoff=a.max_backoff,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
