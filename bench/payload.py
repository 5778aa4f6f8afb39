"""`python -m bench.payload [--quick] [--repeats 3] [--slaves 2] [--out bench-report]`: joins with the streams'
own columns against the same join without them.

The target: with three payload columns per side (one of them a string of about 20 bytes) results carry
them at a sustained rate of at least 0.85 of that of the same workload without payload.  A third mode also
publishes the results on the result stream (`output.zmq_endpoint`: TABLEs with the columns, no subscriber, so
the engine's own cost of gathering, encoding and publishing them); its ratio is reported, with no target.

The default workload is written once as two declared streams (a Parquet file each: id, key, ts in microseconds
and the payload columns `label` (20-byte text), `amount` (float64), `qty` (int32)); unpaced runs alternate
`streams.*.payload = []` and `"*"`, and the report gives each side's in-run rates, the ratio of the medians, the
bytes of window state per tuple against the raw input's bytes per row (the windows hold fixed-width tuples;
the payload waits in the payload log, protocol.payload), and the payload log's size per input byte.
Output: payload.md, payload.json.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.ab import Comparison, parser
from bench.cluster import RunFailed, run_cluster
from protocol.plan import load_plan
from protocol.tuples import STREAM_NAMES
from common.workload import GeneratorSource

if TYPE_CHECKING:
    from protocol.plan import Generator

RATE_TARGET = 0.85
STREAMS = ("bids", "asks")


def payload_columns(side: int, ids: np.ndarray, values: np.ndarray) -> dict:
    """This bench's payload of a stream's tuples: `label` (20-byte text), `amount` (float64), `qty` (int32)."""
    return {
        "label": pc.binary_join_element_wise(
            f"{STREAM_NAMES[side]}-order-", pc.utf8_lpad(pc.cast(pa.array(ids), pa.string()), 12, "0"), ""
        ),  # R-order-000000000042
        "amount": values,
        "qty": (ids % 1000).astype(np.int32),
    }


def write_streams(gen: Generator, folder: Path, payload=payload_columns, streams: tuple[str, str] = STREAMS) -> dict:
    """The generator's tuples as one Parquet file per stream (id, key, ts in microseconds) with the columns
    `payload(side, ids, values)` makes; their rows and in-memory (Arrow) bytes per stream."""
    src = GeneratorSource(gen)
    writers: dict[int, pq.ParquetWriter] = {}
    sizes = {name: {"rows": 0, "bytes": 0} for name in streams}
    while (c := src.next_chunk(1 << 20)) is not None:
        for side, name in enumerate(streams):
            mine = c.stream == side
            ids = c.id[mine]
            table = pa.table({"id": ids, "key": c.key[mine], "ts": c.ts[mine], **payload(side, ids, c.value[mine])})
            if side not in writers:
                writers[side] = pq.ParquetWriter(folder / f"{name}.parquet", table.schema)
            writers[side].write_table(table)
            sizes[name]["rows"] += table.num_rows
            sizes[name]["bytes"] += table.nbytes
    for w in writers.values():
        w.close()
    return sizes


def stream_settings(folder: Path, streams: tuple[str, str] = STREAMS) -> list[str]:
    """The `[streams.*]` settings that read write_streams' files in `folder`."""
    return [
        f"streams.{n}.{k}={v}"
        for n in streams
        for k, v in (
            ("path", folder / f"{n}.parquet"),
            ("key", "key"),
            ("time", "ts"),
            ("time_unit", "us"),
            ("id", "id"),
        )
    ]


def main(argv: list[str]) -> int:
    a = parser("python -m bench.payload", __doc__, 15.0, 30.0, 3).parse_args(argv)
    gen = load_plan(None, [f"generator.duration={15.0 if a.quick else 30.0}"]).generator
    try:
        with tempfile.TemporaryDirectory(prefix="streamjoin-payload-") as tmp:
            sizes = write_streams(gen, Path(tmp))
            workload = stream_settings(Path(tmp))
            ab = Comparison(
                "python -m bench.payload " + " ".join(argv),
                a,
                workload,
                {
                    "none": [f"streams.{n}.payload=[]" for n in STREAMS],
                    "payload": [f'streams.{n}.payload="*"' for n in STREAMS],
                    "streamed": [
                        *(f'streams.{n}.payload="*"' for n in STREAMS),
                        "output.zmq_endpoint=tcp://127.0.0.1:0",
                    ],
                },
            )
            ab.run(Path(tmp) / "runs")
            s = run_cluster(a.slaves + 1, [*workload, *ab.modes["payload"]], Path(tmp) / "state", a.timeout)
    except RunFailed as e:
        print(f"bench.payload: a run failed: {e}", file=sys.stderr)
        return 1
    rows = sum(x["rows"] for x in sizes.values())
    raw = sum(x["bytes"] for x in sizes.values()) / rows
    window = [(x["window_bytes"], x["window_tuples"]) for x in s["slaves"].values()]
    held = sum(b for b, _ in window) / max(1, sum(t for _, t in window))
    state = ab.data["state"] = {
        "input_rows": rows,
        "raw_bytes_per_row": round(raw, 1),
        "window_bytes_per_tuple": round(held, 1),
        "window_bytes_per_raw_byte": round(held / raw, 3),
        "payload_log_bytes_per_raw_byte": round(s["payload_log_bytes"] / (raw * rows), 3),
    }
    ab.write(
        "payload",
        "Results with three payload columns per side against none",
        "payload",
        [
            ab.verdict(RATE_TARGET),
            "",
            f"streamed/none = {ab.data['ratios']['streamed']:.3f}: the same results also on the result stream "
            "(no subscriber; no target).",
            "",
            f"State: {state['window_bytes_per_tuple']} bytes of window per tuple held against "
            f"{state['raw_bytes_per_row']} bytes per raw input row (Arrow, all columns): "
            f"{state['window_bytes_per_raw_byte']} bytes of window per raw byte; the payload log (on disk, "
            f"protocol.payload) {state['payload_log_bytes_per_raw_byte']} bytes per raw byte.",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
