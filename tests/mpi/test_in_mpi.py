"""Tests that run inside an MPI job (pytest-mpi): `mpirun -n 3 python -m pytest --with-mpi tests/mpi`.

Every rank runs each test; rank 0 plays the master, the others the slaves,
through the same protocol calls the engine uses.
"""

from __future__ import annotations

import numpy as np
import pytest

from protocol.messages import TAG_DATA, decode_batch, encode_batch
from protocol.plan import load_plan
from protocol.mpi import recv_bytes, wait_probe
from protocol.tuples import tuple_dtype

pytestmark = pytest.mark.mpi(min_size=2)


def test_batches_cross_real_mpi_intact():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    dtype = tuple_dtype(64)
    if comm.rank == 0:
        rng = np.random.default_rng(1)
        sent = []
        for dest in range(1, comm.size):
            r, s = np.zeros(1000 * dest, dtype), np.zeros(500, dtype)
            for a in (r, s):
                a["id"], a["key"], a["ts"] = (
                    np.arange(len(a)),
                    rng.integers(0, 99, len(a)),
                    rng.integers(0, 10**6, len(a)),
                )
            buf = encode_batch(dest, 1_500_000, r, s)
            sent.append((comm.Isend([buf, MPI.BYTE], dest=dest, tag=TAG_DATA), buf))
        MPI.Request.Waitall([req for req, _ in sent])
        checks = comm.gather(None, root=0)
        assert all(checks[1:])
    else:
        head, r, s = decode_batch(recv_bytes(comm, wait_probe(comm, 0, TAG_DATA, timeout=30)), dtype)
        ok = (
            head["seq"] == comm.rank
            and head["watermark"] == 1_500_000
            and len(r) == 1000 * comm.rank
            and len(s) == 500
            and np.array_equal(r["id"], np.arange(len(r)))
        )
        comm.gather(bool(ok), root=0)


def test_whole_engine_in_one_mpi_job_matches_reference(tmp_path_factory):
    """Master and slaves of one job, in-process, against the reference join."""
    from mpi4py import MPI
    from master.run import Master
    from master.sources import open_source
    from common.workload import generate_all
    from slave.run import run as run_slave
    from protocol.output import read_tables
    from tests.reference import encode_pairs, reference_pairs

    comm = MPI.COMM_WORLD
    out = comm.bcast(str(tmp_path_factory.mktemp("out")) if comm.rank == 0 else None, root=0)
    settings = [
        "generator.duration=3",
        "generator.rate=3000",
        "generator.keys=1024",
        "generator.disorder=0.2",
        "join.window=0.4",
        "join.max_delay=0.3",
        "epochs.distribution=0.1",
        "source.rate=20000",
        f"output.path={out}",
        "output.progress=0",
        'metrics.endpoint="127.0.0.1:0"',
    ]
    plan = load_plan(None, settings)
    if comm.rank != 0:
        assert run_slave(comm) == 0
        return
    comm.bcast(plan, root=0)
    comm.bcast(None, root=0)  # no checkpoint to resume from: the slaves start empty
    summary = Master(comm, plan, open_source(plan)).run()
    data = generate_all(plan.generator)
    expected, late = reference_pairs(data.stream, data.id, data.ts, data.key, 0.4, 0.3)
    results = read_tables(f"{out}/results")
    got = encode_pairs(results["r_id"].to_numpy(), results["s_id"].to_numpy())
    assert np.array_equal(got, expected)
    assert summary["late"] == len(late) and summary["results"] == len(expected)
