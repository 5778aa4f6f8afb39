"""The installed tool as a user gets it: the wheel of this checkout, installed with its dependencies from the
package index into a fresh venv, runs the clicks example from a folder outside the checkout.

The wheel is built from a copy of the checkout: pip builds in the source folder, and a `build/` left there
from an earlier build would put modules since removed into the wheel.  The venv is the base interpreter's,
with nothing but the wheel and what it requires; the example's folder, the commands' working folder and their
environment (no PYTHONPATH) know nothing of the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from control.supervise import Hosts, is_hosted_launch

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "examples" / "clicks"
#: what pip says when the package index cannot be reached (then there is nothing to install from: a skip)
UNREACHABLE = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ProxyError",
)
#: results as the example writes them: each stream's own columns, named <stream>_<column>
COLUMNS = [
    "impressions_impression_id",
    "impressions_user_id",
    "impressions_ad_id",
    "impressions_shown_at",
    "clicks_click_id",
    "clicks_user_id",
    "clicks_clicked_at",
    "clicks_cost",
]

pytestmark = pytest.mark.cluster


def pip(python: Path, *args: str) -> None:
    proc = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        reason = next((line for line in proc.stderr.splitlines() if any(m in line for m in UNREACHABLE)), None)
        if reason:
            pytest.skip(f"pip cannot reach the package index: {reason.strip()}")
        pytest.fail(f"pip {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel of this checkout and its dependencies."""
    base = tmp_path_factory.mktemp("install")
    source, wheels, env = base / "source", base / "wheels", base / "venv"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "out", "bench-report", "bench-data"),
    )
    pip(Path(sys.executable), "wheel", "--no-deps", "--quiet", "--wheel-dir", str(wheels), str(source))
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    pip(env / "bin" / "python", "install", "--quiet", *map(str, wheels.glob("streamjoin-*.whl")))
    return env


@pytest.fixture(scope="module")
def user(tmp_path_factory, venv) -> dict:
    """A user's folder outside the checkout with the clicks example in it (paths relative to it), and the
    environment the commands run in there: the venv first on PATH, no PYTHONPATH, root allowed to mpirun."""
    folder = tmp_path_factory.mktemp("user")
    assert not folder.is_relative_to(ROOT)
    shutil.copy(EXAMPLE / "make_data.py", folder)
    config = (EXAMPLE / "clicks.toml").read_text().replace('"examples/clicks/', '"')
    paths = [s["path"] for s in tomllib.loads(config)["streams"].values()] + [tomllib.loads(config)["output"]["path"]]
    assert paths == ["data/impressions", "data/clicks.parquet", "out"]
    (folder / "clicks.toml").write_text(config)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    made = subprocess.run(
        [str(venv / "bin" / "python"), "make_data.py", "data"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    return {"cwd": folder, "env": env, "bin": venv / "bin"}


def run(user: dict, program: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The venv's `program` run in the user's folder."""
    return subprocess.run(
        [str(user["bin"] / program), *args],
        cwd=user["cwd"],
        env=user["env"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def expected_pairs(folder: Path) -> set[tuple[int, int]]:
    """(impression_id, click_id) of every click 0 to 30 s after an impression of the same user."""
    times = pacsv.ConvertOptions(column_types={"shown_at": pa.timestamp("ms", "UTC")})
    impressions = pa.concat_tables(
        pacsv.read_csv(f, convert_options=times) for f in sorted((folder / "impressions").glob("*.csv"))
    )
    pairs = impressions.join(pq.read_table(folder / "clicks.parquet"), "user_id")
    gap = pc.subtract(pc.cast(pairs["clicked_at"], pa.int64()), pc.cast(pairs["shown_at"], pa.int64()))
    pairs = pairs.filter(pc.and_(pc.greater_equal(gap, 0), pc.less_equal(gap, 30_000)))
    return set(zip(pairs["impression_id"].to_pylist(), pairs["click_id"].to_pylist()))


def assert_exact(out: Path, data: Path) -> None:
    """The run's results hold the example's columns and each expected pair once, and nothing else."""
    table = pq.read_table(out / "results")
    assert table.num_rows > 0 and set(COLUMNS) <= set(table.column_names), table.schema
    pairs = list(zip(table["impressions_impression_id"].to_pylist(), table["clicks_click_id"].to_pylist()))
    assert len(pairs) == len(set(pairs)) and set(pairs) == expected_pairs(data)


def test_the_installed_tool_works_from_a_folder_outside_the_checkout(user):
    """`streamjoin run` joins the example exactly, and so does the tool under its own supervisor; the engine's
    packages are no top-level names of the venv; the version, the help of the tool and of each command, a wrong
    command.  One test, so that one venv is built: xdist's groups no longer keep tests on one worker (pytest 9.2
    with pytest-xdist 3.8)."""
    launched = run(
        user,
        "streamjoin",
        "run",
        "-n",
        "3",
        "--",
        "--config",
        "clicks.toml",
        "--set=metrics.endpoint=127.0.0.1:0",
        timeout=600,
    )  # tests run side by side
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert_exact(user["cwd"] / "out", user["cwd"] / "data")
    assert f"look at the run again: streamjoin dashboard {user['cwd'] / 'out'}" in launched.stderr

    # the supervisor's cluster command is a command line (found on PATH), here the tool's own
    supervised = run(
        user,
        "python",
        "-m",
        "streamjoin",
        "supervise",
        "--",
        "streamjoin",
        "run",
        "-n",
        "3",
        "--",
        "--config",
        "clicks.toml",
        "--set=output.path=supervised",
        "--set=metrics.endpoint=127.0.0.1:0",
        timeout=600,
    )
    assert supervised.returncode == 0, supervised.stdout + supervised.stderr
    assert_exact(user["cwd"] / "supervised", user["cwd"] / "data")

    # the engine's packages are the tool's own, not top-level names of the venv
    hidden = run(user, "python", "-c", "import master")
    assert hidden.returncode == 1 and "No module named 'master'" in hidden.stderr
    where = run(user, "python", "-c", "import streamjoin; print(streamjoin.ENGINE_ROOT)")
    assert where.returncode == 0 and Path(where.stdout.strip()).parts[-3:] == ("site-packages", "streamjoin", "_engine")

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert run(user, "streamjoin", "--version").stdout == f"streamjoin {version}\n"
    listed = run(user, "streamjoin", "--help").stdout
    for command in [
        "run",
        "launch",
        "supervise",
        "audit",
        "aggregate",
        "replay",
        "dashboard",
        "produce",
        "subscribe",
        "checkpoints",
    ]:
        assert f"  {command}" in listed or f", {command}" in listed
        own = run(user, "streamjoin", command, "--help")
        said = {"launch": "run"}.get(command, command)  # each says how the user runs it: this command
        assert own.returncode == 0 and own.stdout.startswith(f"usage: streamjoin {said} "), (command, own.stdout)
    unknown = run(user, "streamjoin", "joni")
    assert unknown.returncode == 2 and "unknown command 'joni'" in unknown.stderr
    assert run(user, "streamjoin", "run", "-n", "3", "--", "--config", "missing.toml").returncode == 2


@pytest.mark.parametrize(
    "launcher", [["streamjoin", "run"], ["/opt/sj/bin/streamjoin", "launch"], ["python", "-m", "streamjoin", "run"]]
)
def test_supervise_knows_streamjoin_run_with_a_hostfile_for_the_launcher(tmp_path, launcher):
    """A restart of `streamjoin run --hostfile` leaves out the hosts that do not answer, as deploy.launch's."""
    (tmp_path / "hosts").write_text("a slots=2\nb slots=3\n")
    command = [*launcher, "-n", "5", "--hostfile", str(tmp_path / "hosts"), "--", "--set", "cluster.dispatchers=1"]
    assert is_hosted_launch(command)
    assert not is_hosted_launch(["streamjoin", "audit", *command[len(launcher) :]])
    restart, used = Hosts(command, tmp_path).for_restart({"b"}, min_slaves=1)
    assert used == {"hosts": ["b"], "left_out": ["a"], "slaves": 2}
    assert restart[: len(launcher)] == launcher and restart[restart.index("-n") + 1] == "3"
