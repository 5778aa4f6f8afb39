"""Hosts: the hostfile, where each rank goes, and whether a host answers.

Open MPI 5 maps ranks by core on the first host whenever `--oversubscribe` is
given, whatever the hostfile says, so the launcher decides the placement
itself: hosts are filled in the hostfile's order up to their slots, and only
when the ranks outnumber all slots does each host take more, in proportion to
its slots (the launcher says so).  Open MPI gets a hostfile with exactly those
counts, so it has nothing left to decide.  The supervisor probes each host the
way Open MPI reaches it (its rsh/ssh agent) before a restart and leaves out those
that do not answer.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Open MPI's agent for starting its daemons on other hosts, and the variable that sets it
AGENT_VARIABLE = "PRTE_MCA_plm_ssh_agent"
DEFAULT_AGENT = "ssh -o BatchMode=yes -o ConnectTimeout=5"
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class HostfileError(ValueError):
    """The hostfile cannot be read or names no usable host; the message names the file and line."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    slots_given: bool = True  #: False: the line had no slots=, counted as 1


def read_hostfile(path: str | Path) -> list[Host]:
    """Open MPI's hostfile format: `name [slots=N] [max_slots=N]` per line, `#` comments; a host named twice
    adds its slots up, as Open MPI does."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise HostfileError(f"hostfile {path}: {e.strerror}") from None
    hosts: dict[str, Host] = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        name, slots, given = words[0], 1, False
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key not in ("slots", "max_slots") or not value.isdigit() or int(value) < 1:
                raise HostfileError(f"hostfile {path}, line {number}: {word!r} is not slots=N or max_slots=N (N >= 1)")
            if key == "slots":
                slots, given = int(value), True
        if name in hosts:
            slots, given = hosts[name].slots + slots, hosts[name].slots_given and given
        hosts[name] = Host(name, slots, given)
    if not hosts:
        raise HostfileError(f"hostfile {path}: names no host")
    return list(hosts.values())


def place(hosts: list[Host], ranks: int) -> list[tuple[Host, int]]:
    """How many ranks each host runs: in order, each up to its slots; ranks beyond all slots go to the hosts
    in proportion to their slots (largest remainders first).  Hosts given no rank are left out."""
    total = sum(h.slots for h in hosts)
    counts = []
    left = ranks
    for h in hosts:
        counts.append(min(h.slots, left))
        left -= counts[-1]
    if left > 0:
        shares = [left * h.slots / total for h in hosts]
        extra = [int(s) for s in shares]
        by_remainder = sorted(range(len(hosts)), key=lambda i: (-(shares[i] - extra[i]), i))
        for i in by_remainder[: left - sum(extra)]:
            extra[i] += 1
        counts = [c + e for c, e in zip(counts, extra)]
    return [(h, c) for h, c in zip(hosts, counts) if c > 0]


def describe(placement: list[tuple[Host, int]]) -> str:
    """One line: each host's ranks, and where a host runs more ranks than it has slots."""
    parts, first = [], 0
    for h, count in placement:
        ranks = f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"
        over = (
            f", {count - h.slots} over its {h.slots} slot{'s' * (h.slots > 1)}: oversubscribed"
            if count > h.slots
            else ""
        )
        note = " (no slots= in the hostfile: counted as 1)" if not h.slots_given else ""
        parts.append(f"{h.name}: {ranks}{over}{note}")
        first += count
    return "placement: " + "; ".join(parts)


def write_placement(placement: list[tuple[Host, int]], path: Path) -> Path:
    """A hostfile that gives each host exactly its ranks as slots (Open MPI then maps by slot as placed)."""
    path.write_text("".join(f"{h.name} slots={count}\n" for h, count in placement))
    return path


def agent() -> list[str]:
    """The command Open MPI starts its daemons on other hosts with (its ssh agent, `PRTE_MCA_plm_ssh_agent`)."""
    return shlex.split(os.environ.get(AGENT_VARIABLE) or DEFAULT_AGENT)


def answers(host: str, timeout: float = 10.0) -> bool:
    """Whether `host` runs a command through the agent within `timeout` seconds (the local host always)."""
    if host in LOCAL_NAMES:
        return True
    try:
        return (
            subprocess.run(
                [*agent(), host, "true"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
