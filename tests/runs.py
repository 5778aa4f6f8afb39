"""Running the real cluster from tests: the project's mpirun command line, real files out."""

from __future__ import annotations

import pytest

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from deploy.launch import mpi_env, mpirun_command
from deploy.ports import free_port  # noqa: F401  (the tests' one import of it)
from protocol import eventtime
from protocol.output import MATCHED, read_tables
from tests.reference import encode_pairs


#: the streaming merger's `until_idle` (control.aggregate.run_stream) over the partials of a run that has ended:
#: every file is there when it starts and its first micro-batches take them all, so it need not wait for more
ENDED_IDLE = 0.2


class Run:
    def __init__(self, out: Path, proc: subprocess.CompletedProcess):
        self.out, self.proc = out, proc
        self.returncode = proc.returncode
        self.stderr = proc.stderr
        summary = out / "summary.json"
        self.summary = json.loads(summary.read_text()) if summary.exists() else None

    def pairs(self, ids: tuple[str, str] = ("r_id", "s_id")) -> np.ndarray:
        """The joined pairs, encoded (tests.reference.encode_pairs) from the result columns `ids` (declared
        streams: their id or row columns); an outer join's rows without a partner are left out (`alone`)."""
        t = read_tables(self.out / "results")
        if t is None:
            return np.empty(0, dtype=np.int64)
        if "kind" in t.column_names:
            t = t.filter(pc.equal(t["kind"], MATCHED))
        return encode_pairs(t[ids[0]].to_numpy(), t[ids[1]].to_numpy())

    def alone(self, side: str, ids: tuple[str, str] = ("r_id", "s_id")) -> np.ndarray:
        """Sorted ids of the rows of `side` ("r" or "s") emitted without the other side (outer, semi, anti)."""
        t = read_tables(self.out / "results")
        if t is None or "kind" not in t.column_names:
            return np.empty(0, dtype=np.int64)
        mine, other = ids if side == "r" else ids[::-1]
        return np.sort(t[mine].filter(pc.is_null(t[other])).to_numpy())

    def late_ids(self, ids: tuple[str, str] = ("id", "id"), streams: tuple[str, str] = ("R", "S")) -> np.ndarray:
        """Sorted late tuples encoded stream * 2**40 + id; declared streams: `ids` their id or row columns in
        the late rows, `streams` their names."""
        t = read_tables(self.out / "late")
        if t is None:
            return np.empty(0, dtype=np.int64)
        stream = (pc.equal(t["stream"], streams[1])).to_numpy(zero_copy_only=False)
        ident = pc.coalesce(t[ids[0]], t[ids[1]]) if ids[0] != ids[1] else t[ids[0]]
        return np.sort(stream.astype(np.int64) * 2**40 + ident.to_numpy())


def toml_value(v) -> str:
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    return json.dumps(v) if isinstance(v, str) else repr(v).lower() if isinstance(v, bool) else repr(v)


def run_cluster(
    tmp: Path,
    ranks: int,
    settings: dict[str, object],
    timeout: float = 180,
    extra_args: list[str] = (),
    wrapper: list[str] = (),
    env: dict[str, str] | None = None,
) -> Run:
    """Run `mpirun -n ranks python -m master --config tmp/run.toml`; settings are 'section.key': value.

    `wrapper` goes in front of the command (e.g. the supervisor), `env` adds environment variables.
    """
    cfg = write_config(tmp, settings)
    cmd = [*wrapper, *mpirun_command(ranks, ["--config", str(cfg), *extra_args])]
    proc = subprocess.run(cmd, env={**mpi_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout)
    return Run(tmp / "out", proc)


class BedJob:
    """deploy.launch (or the supervisor around it) started on host 1 of the bed, its stderr read line by line."""

    def __init__(
        self,
        bed,
        tmp_path: Path,
        ranks: int,
        slots: list[int],
        settings: dict,
        wrapper=(),
        env: dict | None = None,
        hosts: list[int] | None = None,
    ):
        """`slots`: of each host of `hosts` (all the bed's by default); `env` adds environment variables."""
        self.out = tmp_path / "out"
        cmd = [
            *wrapper,
            sys.executable,
            "-m",
            "deploy.launch",
            "-n",
            str(ranks),
            "--hostfile",
            str(bed.hostfile(slots, hosts)),
            "--",
            "--config",
            str(write_config(tmp_path, settings)),
        ]
        self.watched = bed.start(0, cmd, {**mpi_env(), **(env or {})})

    def wait_for(self, needle, timeout: float = 120) -> str:
        return self.watched.wait_for(needle, timeout)[1]

    def finish(self, timeout: float = 180) -> Run:
        code = self.watched.wait(timeout)
        return Run(self.out, subprocess.CompletedProcess(self.watched.proc.args, code, "", self.watched.stderr()))


def write_config(tmp: Path, settings: dict[str, object]) -> Path:
    """`tmp/run.toml` with `settings` ('section.key': value), output to `tmp/out`, no progress lines, metrics
    served on any free port (tests run side by side)."""
    sections: dict[str, dict[str, object]] = {
        "output": {"path": str(tmp / "out"), "progress": 0.0},
        "metrics": {"endpoint": "127.0.0.1:0"},
    }
    for name, value in settings.items():
        section, key = name.split(".", 1)
        sections.setdefault(section, {})[key] = value
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "run.toml"
    cfg.write_text(
        "".join(
            f"[{s}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()) for s, keys in sections.items()
        )
    )
    return cfg


def file_source(path: Path, window: int | None = None, listing=None, ts_unit: str = "s"):
    """The single file `path` as the master reads it (`source.kind = "file"`: master.sources.streams), its rejected
    rows into `listing`; `window` = source.duplicate_window (None: the default)."""
    from master.sources.streams import StreamsSource
    from protocol.config import load_config
    from protocol.plan import compile_plan

    cfg = load_config()
    cfg["source"].update(kind="file", path=str(path), ts_unit=ts_unit)
    if window is not None:
        cfg["source"]["duplicate_window"] = window
    return StreamsSource(compile_plan(cfg), listing)


def write_input(path: Path, data, row_group: int = 1 << 20, bad_every: int = 0) -> np.ndarray:
    """The tuples of `data` (a Chunk) as a CSV or Parquet input file (Parquet in row groups of `row_group` rows),
    with a row whose ts is missing inserted after every `bad_every` rows, so the accepted tuples are `data`;
    returns the 1-based rows of the inserted ones."""
    at = np.arange(bad_every, len(data.id), bad_every) if bad_every else np.empty(0, np.int64)
    cols = {
        "stream": np.array(["R", "S"])[data.stream].astype(object),
        "id": data.id,
        "ts": eventtime.to_seconds(data.ts),  # the user's seconds
        "key": data.key,
        "value": data.value,
    }
    table = pa.table({c: np.insert(v, at, v[at]) for c, v in cols.items()})
    bad = at + np.arange(len(at))
    missing = np.zeros(table.num_rows, bool)
    missing[bad] = True
    table = table.set_column(2, "ts", pa.array(table["ts"].to_numpy(), mask=missing))  # "ts is not a number"
    if path.suffix == ".csv":
        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path, row_group_size=row_group)
    return bad + 1


def soak(*values):
    """A parametrized case that `make soak` runs and `make test` leaves out: a variant of a case the quick suite
    keeps (another victim, another dispatcher count), which the suite's ten minutes have no room for."""
    return pytest.param(*values, marks=pytest.mark.soak)
