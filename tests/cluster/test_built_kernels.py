"""The kernels built ahead of time (deploy.kernels, protocol.compiled): built once by the launcher, loaded by the
ranks without numba, and computing what numba's compilation of the same source computes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from deploy.kernels import AHEAD
from deploy.launch import KERNEL_MODULES, kernel_stamp
from protocol.compiled import KERNELS_ENV, built_module, kernel_sources

ROOT = Path(__file__).resolve().parent.parent.parent


def python(code: str, **env: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, check=True
    ).stdout.split()[-1]


def outputs() -> str:
    """A digest of every built kernel's output on random inputs, through the modules' own entry points."""
    from common.read_passes import _merge, _numbers, _rising, _tops, _watermarks
    from master.state.lateness import _late
    from common.payload_passes import _places, _segments
    from master.state.packing import to_wire, to_wire_hashed
    from protocol.tuples import tuple_dtype
    from slave.kernel import batch_delays, gather_pairs, range_matches, window_matches

    rng = np.random.default_rng(7)
    n = 3000
    key, ts = rng.integers(0, 50, n), np.sort(rng.integers(0, 10**6, n))
    key2, ts2 = rng.integers(0, 50, n // 2), np.sort(rng.integers(0, 10**6, n // 2))
    out = []
    for m in (window_matches(key, ts, key2, ts2, -5000, 9000), range_matches(key, ts, key2, ts2, -900, 900, -2, 3)):
        ia, ib = m.take(0, m.total)
        out += [ia, ib]
    words = rng.integers(-(2**40), 2**40, (n, 8))
    out.append(gather_pairs([(words, out[0], words[: n // 2], out[1])], np.array([0, 3, 5]), len(out[0])))
    arrival = rng.random(n)
    out += list(batch_delays(arrival, arrival[::-1].copy(), np.array([n // 3, n]), np.array([2.0, 3.0]), 1.0, 1.5))
    stream = rng.integers(0, 2, n).astype(np.int8)
    dt = tuple_dtype(64)
    cols = (np.arange(n), ts, key, rng.random(n), arrival)
    for rows, sizes in to_wire_hashed(dt, stream, *cols, rng.random(n) < 0.1, 7):
        out += [rows.view(np.uint8), sizes]
    out.append(to_wire(dt, *cols, rng.permutation(n)).view(np.uint8))
    running, own, late = np.full(2, -(2**62)), np.empty(n, np.int64), np.empty(n, bool)
    _late(rng.permutation(ts), stream, np.array([0, 1], np.int8), running, np.array([300, 700]), 10, late, own)
    out += [own, late]
    ids, tops, has, suspect = rng.integers(0, n, n), np.array([5, 0]), np.array([True, False]), np.zeros(n, bool)
    code, is_s = (rng.random(n) < 0.05).astype(np.int8), rng.random(n) < 0.5
    out += [np.array([_rising(code, is_s, ids, tops, has, suspect)]), tops, has, suspect]
    _tops(stream, ids, tops, has)
    out += [tops, has]
    x = np.concatenate([rng.uniform(-3e9, 3e9, n), [np.nan, np.inf, 0.5, 1.5, 2.5e-6, 1e300]])
    ticks, ok = np.empty(len(x), np.int64), np.empty(len(x), bool)
    _numbers(x, 1e3, 2**62, ticks, ok)
    marks = np.empty(n, np.int64)
    out += [ticks, ok, np.array([_watermarks(rng.permutation(ts), 17, 250, marks)]), marks]
    r, s_ = (np.sort(rng.integers(0, 10**4, k)) for k in (n, n // 2))
    merged = [np.zeros(n + n // 2 + 3, t) for t in (np.int8, np.int64, np.int64, np.int64)]
    source = np.empty(n + n // 2, np.int64)
    _merge(r, r + 1, r + 2, r, s_, s_ + 1, s_ + 2, s_, *merged, source, 3)
    out += [*merged, source]
    firsts = np.array([0, 100, 250, 900])
    asked, seg, used, index = rng.integers(-5, 1000, n), np.zeros(n, np.int64), np.zeros(4, bool), np.zeros(n, np.int64)
    out += [np.array([_segments(asked, firsts, firsts + 90, seg, used)]), seg, used]
    out += [np.array([_places(asked, seg, np.array([3, -7, 11, 0]), index)]), index]
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in out)).hexdigest()


def test_the_launcher_builds_the_kernels_once_and_the_ranks_load_them_without_numba():
    # built at `make setup` or by the last launch after a change; a launch with the note of them current runs
    # no build (about 15 s before mpirun may start)
    stamp, state = kernel_stamp()
    launches = (
        "import subprocess; runs = []; subprocess.run = lambda *a, **k: runs.append(a); "
        "from deploy.launch import warm_kernels; warm_kernels(); print(len(runs))"
    )
    if stamp.exists() and stamp.read_text() == state:
        assert python(launches) == "0"
    else:
        subprocess.run([sys.executable, "-c", "from deploy.launch import warm_kernels; warm_kernels()"], cwd=ROOT)
        assert stamp.read_text() == state
    for module in AHEAD:
        source = ROOT / Path(*module.split(".")).with_suffix(".py")
        assert built_module(source)[1].exists(), module
    loads = (
        "import common.read_passes, common.payload_passes, master.state.lateness, master.state.packing, "
        "slave.kernel, sys; print('numba' in sys.modules)"
    )
    assert python(loads) == "False"
    # every module with compiled kernels is in the note (a change to it builds again)
    compiled = sorted(
        ".".join(f.relative_to(ROOT).with_suffix("").parts)
        for d in ("common", "protocol", "master", "slave")
        for f in (ROOT / d).rglob("*.py")
        if "= kernels(" in f.read_text() or "@njit(" in f.read_text()
    )
    assert compiled == sorted(KERNEL_MODULES)


def test_the_built_kernels_compute_what_numba_compiles_from_the_same_source():
    digest = "from tests.cluster.test_built_kernels import outputs; print(outputs())"
    assert python(digest) == python(digest, **{KERNELS_ENV: "jit"})


def test_a_changed_kernel_module_is_not_run_from_its_older_build(tmp_path):
    source = tmp_path / "kern.py"
    source.write_text("X = 1\n")
    before = built_module(source)
    source.write_text("X = 22\n")
    after = built_module(source)
    assert before[1].parent == after[1].parent == tmp_path / "__pycache__" and before != after


def test_a_changed_constant_in_a_module_the_kernels_import_from_names_a_new_build(tmp_path, monkeypatch):
    """A build freezes the constants its kernels read from other modules (the routing pass: protocol.tuples'
    hash multipliers): a change there alone must not run the old build, nor skip the launcher's rebuild."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "consts.py").write_text("M = 1\n")
    source = tmp_path / "kern.py"
    source.write_text("from consts import M\nimport numpy\n")
    before = built_module(source)
    (tmp_path / "consts.py").write_text("M = 3\n")
    assert built_module(source) != before
    assert ROOT / "protocol" / "tuples.py" in kernel_sources(ROOT / "master" / "state" / "packing.py")
