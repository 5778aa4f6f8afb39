"""The duplicate-id check's window (common.stream_file.IdCheck) holds the good rows of the last `window` rows,
however the rows came: in batches, or resumed from a checkpoint's window again and again (a live stream restarted
crash after crash, each run reading fewer rows than the window), and it marks the same rows either way."""

from __future__ import annotations

import numpy as np

from common.stream_file import IdCheck, Parsed

WINDOW, BATCH = 100, 10
DUPLICATE = 9


def batches(n: int):
    """`n` batches of BATCH rows: ids mostly rising, some repeating one a few rows back, some far back."""
    rng = np.random.default_rng(5)
    ids = np.arange(n * BATCH) * 2
    back = rng.integers(1, 3 * WINDOW, len(ids))
    repeat = rng.random(len(ids)) < 0.2
    ids[repeat] = ids[np.maximum(0, np.arange(len(ids)) - back)[repeat]]
    for k in range(n):
        rows = np.arange(k * BATCH, (k + 1) * BATCH)
        yield rows, ids[rows]


def marked(check: IdCheck, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    n = len(rows)
    p = Parsed(np.zeros(n, np.int8), np.zeros(n, bool), ids, ids, ids, ids, {})
    first = check.mark(p, rows)
    return np.where(p.code == DUPLICATE, first, -1)


def test_a_window_resumed_crash_after_crash_stays_the_window_and_marks_the_same_rows():
    steady, restarted = IdCheck(WINDOW, DUPLICATE), IdCheck(WINDOW, DUPLICATE)
    longest = 0
    for k, (rows, ids) in enumerate(batches(300)):
        np.testing.assert_array_equal(marked(restarted, rows, ids), marked(steady, rows, ids))
        if k % 3 == 2:  # a checkpoint, a crash, a recovery from it: fewer rows a run than the window
            kept, max_id = restarted.window_rows(), list(restarted.max_id)
            longest = max(longest, len(kept[0]))
            restarted = IdCheck(WINDOW, DUPLICATE)
            restarted.resume(max_id, *kept)
    assert longest <= WINDOW + BATCH
    assert len(steady.window_rows()[0]) <= WINDOW + BATCH
