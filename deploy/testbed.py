"""Several hosts on one machine, for the tests and the failover bench: network namespaces as hosts.

Each host is a network namespace with its own address on a bridge (the bridge in a namespace of its own, so
the machine's own network never sees them), its own host name (each process it runs is in its own UTS
namespace), and Open MPI reaches it through `agent`, an rsh agent that behaves as ssh and sshd do: the
command runs in a clean environment on the host, and a host that cannot be reached makes the agent fail with
255 after a connect timeout.  A host is cut off by setting its link down (`cut`), as a pulled cable would.
Needs root (`ip netns`); the file system is shared, as a cluster's shared checkout and output folder are.

    with TestBed(3) as bed:
        subprocess.run(bed.on(0, "python", "-m", "deploy.launch", "-n", "5", "--hostfile", bed.hostfile()),
                       env=bed.env())

`python deploy/testbed.py agent MAP HOST COMMAND...` is the agent itself (the path is what Open MPI runs).
"""

from __future__ import annotations

import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

SUBNET = "10.77.0"  #: the hosts' addresses, SUBNET.1 .. SUBNET.n: they exist only inside the namespaces
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  #: sshd's PATH for a command


class TestBedError(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, no namespaces in this kernel)."""

    __test__ = False  # a tool, not a test class


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise TestBedError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class TestBed:
    __test__ = False  # a tool, not a test class

    def __init__(self, hosts: int):
        self.n = hosts
        self.tag = uuid.uuid4().hex[:6]  #: in every namespace and link name: test beds side by side never meet
        self.dir = Path(tempfile.mkdtemp(prefix=f"streamjoin-testbed-{self.tag}."))
        self.map = self.dir / "hosts.map"

    def ns(self, i: int) -> str:
        return f"sj{self.tag}-h{i + 1}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def name(self, i: int) -> str:
        return f"h{i + 1}"

    @property
    def bridge(self) -> str:
        return f"sj{self.tag}-br"

    def __enter__(self) -> TestBed:
        if os.geteuid() != 0:
            raise TestBedError("network namespaces need root")
        try:
            _ip("netns", "add", self.bridge)
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for i in range(self.n):
                _ip("netns", "add", self.ns(i))
                _ip("-n", self.ns(i), "link", "set", "lo", "up")
                _ip(
                    "link",
                    "add",
                    f"sj{self.tag}v{i}",
                    "netns",
                    self.ns(i),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"sj{self.tag}p{i}",
                    "netns",
                    self.bridge,
                )
                _ip("-n", self.bridge, "link", "set", f"sj{self.tag}p{i}", "master", "br0", "up")
                _ip("-n", self.ns(i), "addr", "add", f"{self.address(i)}/24", "dev", f"sj{self.tag}v{i}")
                _ip("-n", self.ns(i), "link", "set", f"sj{self.tag}v{i}", "up")
        except (TestBedError, OSError) as e:
            self.__exit__()
            raise TestBedError(str(e)) from None
        self.map.write_text("".join(f"{self.address(i)} {self.name(i)} {self.ns(i)}\n" for i in range(self.n)))
        return self

    def __exit__(self, *exc) -> None:
        """Kill what runs in the hosts, remove them (their links go with them) and the bridge."""
        for ns in [*(self.ns(i) for i in range(self.n)), self.bridge]:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["rm", "-rf", str(self.dir)])

    def on(self, i: int, *command: str) -> list[str]:
        """`command` run on host i (its namespace and host name), in this environment."""
        return [
            "ip",
            "netns",
            "exec",
            self.ns(i),
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {self.name(i)} && exec "$@"',
            "sh",
            *command,
        ]

    def hostfile(self, slots: list[int], hosts: list[int] | None = None) -> Path:
        """An Open MPI hostfile of the hosts (all by default), by address, with these slots."""
        path = self.dir / f"hostfile-{len(list(self.dir.glob('hostfile-*')))}"
        path.write_text("".join(f"{self.address(i)} slots={s}\n" for i, s in zip(hosts or range(self.n), slots)))
        return path

    def env(self) -> dict[str, str]:
        """Open MPI starts its daemons on the hosts through the agent."""
        return {"PRTE_MCA_plm_ssh_agent": f"{sys.executable} {Path(__file__).resolve()} agent {self.map}"}

    def cut(self, i: int) -> None:
        """Host i's link goes down: nothing reaches it or leaves it; what runs on it goes on."""
        _ip("-n", self.bridge, "link", "set", f"sj{self.tag}p{i}", "down")

    def mend(self, i: int) -> None:
        _ip("-n", self.bridge, "link", "set", f"sj{self.tag}p{i}", "up")

    def start(self, i: int, command: list[str], env: dict[str, str]) -> Watched:
        """`command` started on host i with Open MPI's agent set, its stderr read line by line."""
        return Watched(
            subprocess.Popen(
                self.on(i, *command),
                env={**env, **self.env()},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )

    def pids(self, i: int) -> list[int]:
        """The processes running on host i."""
        out = subprocess.run(["ip", "netns", "pids", self.ns(i)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


class Watched:
    """A process whose stderr lines are kept (`lines`, with the time each came) and can be waited for."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self._new: queue.Queue = queue.Queue()
        self._read_all = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))
            self._new.put((time.monotonic(), line))
        self._new.put((time.monotonic(), None))
        self._read_all.set()

    def wait_for(self, needle, timeout: float = 120) -> tuple[float, str]:
        """(when it came, the line) of the first line from now on containing `needle` (or for which it is true,
        if callable); AssertionError with the last lines when none comes within `timeout` s or the process ends."""
        match = needle if callable(needle) else lambda line: needle in line
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                at, line = self._new.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                self._new.put((at, None))
                break
            if match(line):
                return at, line
        raise AssertionError(f"no line with {needle!r} within {timeout}s; stderr:\n{self.stderr()[-3000:]}")

    def wait(self, timeout: float = 180) -> int:
        """The exit code, once every line is read."""
        code = self.proc.wait(timeout=timeout)
        self._read_all.wait(timeout=5)
        return code

    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)


def reachable(address: str, timeout: float = 3.0) -> bool:
    """Whether `address` answers from here (a refused connection is an answer: the host runs no sshd)."""
    try:
        socket.create_connection((address, 22), timeout=timeout).close()
    except ConnectionRefusedError:
        pass
    except OSError:
        return False
    return True


def agent(map_file: str, host: str, command: list[str]) -> int:
    """The rsh agent: run `command` on `host` as ssh would (sshd's clean environment, the host's name), or fail
    with 255 as ssh does when the host cannot be reached within its connect timeout.  Its output and its end
    reach the caller only while the host is reachable, as over ssh's connection: a host cut off falls silent
    (its processes go on), it does not hang up."""
    hosts = {w[0]: w for w in (line.split() for line in Path(map_file).read_text().splitlines()) if w}
    hosts.update({w[1]: w for w in list(hosts.values())})
    if host not in hosts:
        print(f"ssh: Could not resolve hostname {host}: Name or service not known", file=sys.stderr)
        return 255
    address, name, ns = hosts[host]
    if not reachable(address):
        print(f"ssh: connect to host {host} port 22: Connection timed out", file=sys.stderr)
        return 255
    remote = " ".join(command)
    child = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            ns,
            "env",
            "-i",
            f"PATH={CLEAN_PATH}",
            "HOME=/root",
            "LANG=C.UTF-8",
            "unshare",
            "--uts",
            "sh",
            "-c",
            f"hostname {name} && exec sh -c {shlex.quote(remote)}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    up = threading.Event()
    up.set()

    def watch() -> None:
        while child.poll() is None or not up.is_set():
            (up.set if reachable(address, 0.5) else up.clear)()
            time.sleep(0.5)

    def relay(source, sink) -> None:
        for chunk in iter(lambda: source.read1(65536), b""):
            up.wait()
            sink.write(chunk)
            sink.flush()

    threading.Thread(target=watch, daemon=True).start()
    relays = [
        threading.Thread(target=relay, args=(child.stdout, sys.stdout.buffer)),
        threading.Thread(target=relay, args=(child.stderr, sys.stderr.buffer)),
    ]
    for t in relays:
        t.start()
    code = child.wait()
    for t in relays:
        t.join()
    up.wait()  # the end is heard only once the host is reachable again
    return code


if __name__ == "__main__":
    if sys.argv[1:2] != ["agent"] or len(sys.argv) < 5:
        sys.exit("usage: python deploy/testbed.py agent MAP HOST COMMAND...")
    sys.exit(agent(sys.argv[2], sys.argv[3], sys.argv[4:]))
