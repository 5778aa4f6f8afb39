"""Write a small realistic input for examples/clicks/clicks.toml: ad impressions and clicks, as a site logs them.

    python examples/clicks/make_data.py [OUT]      # OUT defaults to examples/clicks/data

- OUT/impressions/impressions-00N.csv: impression_id, user_id (`u_123`), ad_id, shown_at (ISO-8601 text, UTC),
  one file per 10 minutes, each in the order the site wrote it (up to 2 s out of order);
- OUT/clicks.parquet: click_id, user_id, clicked_at (timestamp[ms, tz=UTC]), cost; most clicks come 1-25 s after
  an impression of the same user, a few are strays.

Nothing to reshape: clicks.toml names the columns as they are.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

START = np.datetime64("2026-11-25T09:00:00", "ms")
MINUTES, USERS, ADS = 30, 400, 25


def main(out: Path, seed: int = 7) -> None:
    rng = np.random.default_rng(seed)
    n = MINUTES * 200  # impressions: 200 a minute
    shown = START + np.sort(rng.integers(0, MINUTES * 60_000, n)).astype("timedelta64[ms]")
    written = shown + rng.integers(0, 2000, n).astype("timedelta64[ms]")  # logged up to 2 s later
    order = np.argsort(written, kind="stable")  # the file's order is the log's order
    users = rng.zipf(1.6, n) % USERS  # a few very active users
    impressions = pa.table(
        {
            "impression_id": np.arange(1, n + 1, dtype=np.int64) + 100_000,
            "user_id": pc.binary_join_element_wise("u_", pa.array(users).cast(pa.string()), ""),
            "ad_id": rng.integers(1, ADS + 1, n),
            "shown_at": np.datetime_as_string(shown, unit="ms", timezone="UTC"),  # 2026-11-25T09:00:00.123Z
        }
    ).take(pa.array(order))
    folder = out / "impressions"
    folder.mkdir(parents=True, exist_ok=True)
    per_file = n // (MINUTES // 10)
    for i in range(MINUTES // 10):
        part = impressions.slice(i * per_file, per_file if i < MINUTES // 10 - 1 else None)
        pacsv.write_csv(part, folder / f"impressions-{i + 1:03d}.csv")

    clicked = rng.random(n) < 0.08  # an impression is clicked 1-25 s after it was shown
    at = shown[clicked] + rng.integers(1000, 25_000, int(clicked.sum())).astype("timedelta64[ms]")
    who = users[clicked]
    strays = 60  # clicks with no impression near them
    at = np.concatenate([at, START + rng.integers(0, MINUTES * 60_000, strays).astype("timedelta64[ms]")])
    who = np.concatenate([who, rng.integers(USERS, 2 * USERS, strays)])
    order = np.argsort(at, kind="stable")
    pq.write_table(
        pa.table(
            {
                "click_id": np.arange(len(at), dtype=np.int64) + 1,
                "user_id": pc.binary_join_element_wise("u_", pa.array(who[order]).cast(pa.string()), ""),
                "clicked_at": pa.array(at[order], pa.timestamp("ms", tz="UTC")),
                "cost": np.round(rng.gamma(2.0, 0.15, len(at)), 2),
            }
        ),
        out / "clicks.parquet",
    )
    print(f"wrote {n:,} impressions in {folder} and {len(at):,} clicks in {out / 'clicks.parquet'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "data")
