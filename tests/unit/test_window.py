"""Tests of slave/window.py: MiniWindow blocks, expiry and take."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.tuples import tuple_dtype
from slave.window import DECIDED, MATCHED, UNMATCHED, MiniWindow

DT = tuple_dtype(48)


def us(seconds):
    """Seconds as the window's integer microseconds."""
    return np.rint(np.asarray(seconds, dtype=np.float64) * 1e6).astype(np.int64)


def make_rows(ids, ts):
    """Rows with ts given in seconds."""
    rows = np.zeros(len(ids), dtype=DT)
    rows["id"], rows["ts"], rows["key"] = ids, us(ts), np.asarray(ids) % 5
    return rows


def recomputed_block_max(w: MiniWindow) -> np.ndarray:
    ts = w.rows["ts"]
    B = w.block_size
    return np.array([ts[i : i + B].max() for i in range(0, len(ts), B)], dtype=np.int64)


def check_blocks(w: MiniWindow):
    assert w.blocks == -(-len(w) // w.block_size)
    np.testing.assert_array_equal(w.block_max, recomputed_block_max(w))
    ts, B = w.rows["ts"], w.block_size
    np.testing.assert_array_equal(w.block_min, [ts[i : i + B].min() for i in range(0, len(ts), B)])


class Model:
    """Plain-list model of a mini-window: rows in order, blocks are consecutive chunks of B."""

    def __init__(self, B):
        self.B, self.ids, self.ts = B, [], []

    def append(self, ids, ts):
        self.ids += list(ids)
        self.ts += list(ts)

    def expire(self, threshold):
        keep_ids, keep_ts = [], []
        for i in range(0, len(self.ids), self.B):
            chunk_ids, chunk_ts = self.ids[i : i + self.B], self.ts[i : i + self.B]
            if max(chunk_ts) >= threshold:
                keep_ids += chunk_ids
                keep_ts += chunk_ts
        dropped = len(self.ids) - len(keep_ids)
        self.ids, self.ts = keep_ids, keep_ts
        return dropped


def test_append_across_partial_head_block():
    w = MiniWindow(DT, 4)
    w.append(make_rows([0, 1, 2], [5.0, 1.0, 2.0]))
    np.testing.assert_array_equal(w.block_max, us([5.0]))
    # fills the partial head block with a larger ts and starts two new blocks
    w.append(make_rows([3, 4, 5, 6, 7, 8, 9], [9.0, 0.5, 0.1, 0.2, 0.3, 7.0, 3.0]))
    np.testing.assert_array_equal(w.block_max, us([9.0, 0.5, 7.0]))
    np.testing.assert_array_equal(w.rows["id"], np.arange(10))
    check_blocks(w)
    w.append(make_rows([], []))
    np.testing.assert_array_equal(w.block_max, us([9.0, 0.5, 7.0]))
    assert len(w) == 10


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("B", [1, 3, 8])
def test_random_appends_keep_block_max(seed, B):
    rng = np.random.default_rng(seed)
    w = MiniWindow(DT, B)
    next_id = 0
    for _ in range(25):
        k = int(rng.integers(0, 2 * B + 3))
        w.append(make_rows(np.arange(next_id, next_id + k), rng.uniform(-5, 5, k)))
        next_id += k
        check_blocks(w)
        np.testing.assert_array_equal(w.rows["id"], np.arange(next_id))


def test_expire_drops_only_blocks_whose_newest_ts_is_below_threshold():
    w = MiniWindow(DT, 3)
    # block 0: newest 10 (old tuples inside), block 1: newest 2, block 2: newest 5, head block: newest 1
    ts = [0.0, 10.0, 1.0, 2.0, 0.0, 1.0, 5.0, 4.0, 3.0, 1.0]
    w.append(make_rows(np.arange(10), ts))
    assert w.expire(-1000000) == 0 and len(w) == 10
    assert w.expire(2000000) == 1  # only the head block (newest 1 < 2); block 1 has newest == 2, kept
    np.testing.assert_array_equal(w.rows["id"], np.arange(9))
    assert w.expire(5000000) == 3  # block 1 (newest 2); block 0 kept although it holds ts 0 and 1
    np.testing.assert_array_equal(w.rows["id"], [0, 1, 2, 6, 7, 8])
    np.testing.assert_array_equal(w.block_max, us([10.0, 5.0]))
    check_blocks(w)
    assert w.expire(10000000) == 3
    np.testing.assert_array_equal(w.rows["id"], [0, 1, 2])
    assert w.expire(10500000) == 3 and len(w) == 0 and w.blocks == 0
    # the window is usable after being emptied
    w.append(make_rows([20, 21], [1.0, 2.0]))
    np.testing.assert_array_equal(w.block_max, us([2.0]))


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("B", [1, 4, 7])
def test_random_append_expire_against_model(seed, B):
    rng = np.random.default_rng(seed)
    w, model = MiniWindow(DT, B), Model(B)
    next_id, t = 0, 0.0
    matched, decided, unmatched = set(), set(), []
    for _ in range(30):
        k = int(rng.integers(0, 3 * B + 2))
        # slowly increasing ts, out of order by up to 3 inside and across blocks
        ts = t + rng.uniform(0, 1, k).cumsum() - rng.uniform(0, 3, k)
        t = float(ts.max()) if k else t
        ids = np.arange(next_id, next_id + k)
        next_id += k
        flags = (rng.random(k) < 0.5).astype(np.uint8)  # matched flags travel with their rows
        w.append(make_rows(ids, ts), flags)
        matched |= set(ids[flags == 1].tolist())
        later = (rng.random(len(w)) < 0.1) & (w.matched == UNMATCHED)  # a stored tuple matched later
        w.matched[later] = 1
        matched |= set(w.rows["id"][later].tolist())
        model.append(ids.tolist(), us(ts).tolist())
        threshold = int(us(t - rng.uniform(1, 6)))
        before_max = w.block_max.copy()
        before_rows = w.rows.copy()
        # a row is decided once, when the threshold first passes its ts with no match: then it can be dropped
        decided |= {i for i, x in zip(model.ids, model.ts) if x < threshold and i not in matched}
        w.decide(threshold, unmatched)
        emitted = np.concatenate(unmatched or [make_rows([], [])])["id"].tolist()
        assert sorted(emitted) == sorted(decided)  # each once
        dropped = w.expire(threshold)
        assert dropped == model.expire(threshold)
        want = np.where(
            np.isin(w.rows["id"], list(matched)),
            MATCHED,
            np.where(np.isin(w.rows["id"], list(decided)), DECIDED, UNMATCHED),
        )
        np.testing.assert_array_equal(w.matched, want)
        np.testing.assert_array_equal(w.rows["id"], model.ids)
        np.testing.assert_array_equal(w.rows["ts"], model.ts)
        check_blocks(w)
        # no tuple of a block with newest ts >= threshold was dropped
        B_ = w.block_size
        must_keep = np.concatenate(
            [before_rows["id"][b * B_ : (b + 1) * B_] for b in np.flatnonzero(before_max >= threshold)]
            or [np.empty(0, int)]
        )
        assert set(must_keep.tolist()) == set(w.rows["id"].tolist())
        assert dropped == len(before_rows) - len(must_keep)


def test_take_returns_masked_rows_and_keeps_rest_in_order():
    rng = np.random.default_rng(3)
    w = MiniWindow(DT, 4)
    ts = rng.uniform(0, 100, 23)
    w.append(make_rows(np.arange(23), ts))
    mask = rng.random(23) < 0.4
    out, _ = w.take(mask)
    np.testing.assert_array_equal(out["id"], np.flatnonzero(mask))
    np.testing.assert_array_equal(out["ts"], us(ts)[mask])
    np.testing.assert_array_equal(w.rows["id"], np.flatnonzero(~mask))
    np.testing.assert_array_equal(w.rows["ts"], us(ts)[~mask])
    check_blocks(w)
    # returned rows are independent of the window's storage
    w.append(make_rows([100, 101], [0.0, 0.0]))
    np.testing.assert_array_equal(out["id"], np.flatnonzero(mask))
    np.testing.assert_array_equal(w.rows["id"], np.concatenate([np.flatnonzero(~mask), [100, 101]]))
    check_blocks(w)


@pytest.mark.parametrize("seed", range(10))
def test_take_all_none_and_then_expire(seed):
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 6))
    w = MiniWindow(DT, B)
    n = int(rng.integers(1, 40))
    ts = rng.uniform(0, 10, n)
    w.append(make_rows(np.arange(n), ts))
    assert len(w.take(np.zeros(n, bool))[0]) == 0 and len(w) == n
    check_blocks(w)
    mask = rng.random(n) < 0.5
    w.take(mask)
    model = Model(B)
    model.append(np.flatnonzero(~mask).tolist(), us(ts)[~mask].tolist())
    assert w.expire(5_000_000) == model.expire(5_000_000)
    np.testing.assert_array_equal(w.rows["id"], model.ids)
    check_blocks(w)
    out, _ = w.take(np.ones(len(w), bool))
    np.testing.assert_array_equal(out["id"], model.ids)
    assert len(w) == 0 and w.blocks == 0


def test_nbytes_counts_the_allocated_rows_and_the_block_index():
    w = MiniWindow(DT, 4)
    w.append(make_rows(np.arange(10), np.arange(10.0)))
    # 10 rows in storage grown to at least 10 (here: exactly 10) plus 3 blocks' newest ts
    assert w.nbytes >= 10 * DT.itemsize + 3 * 8
    assert w.nbytes == len(w._rows) * (DT.itemsize + 1) + w.blocks * 16  # a matched flag per row
    w.expire(4_500_000)  # drops the first block
    assert w.nbytes == len(w._rows) * (DT.itemsize + 1) + 2 * 16 and len(w) == 6


@pytest.mark.parametrize("per_epoch,epochs_kept", [(7, 3), (200, 2), (1000, 8)])
def test_a_steady_window_holds_at_most_twice_its_rows(per_epoch, epochs_kept):
    # tuples arrive in ts order, one epoch's worth at a time, and expire `epochs_kept` epochs later: the storage
    # (live rows, slack, expired rows not yet given back) stays within 2x the live rows
    w = MiniWindow(DT, 4)
    rng = np.random.default_rng(per_epoch)
    worst = 0.0
    for epoch in range(60):
        n = int(rng.integers(per_epoch // 2, per_epoch * 3 // 2 + 1))
        w.append(make_rows(np.arange(n) + epoch * 10 * per_epoch, epoch + np.sort(rng.random(n))))
        w.expire((epoch + 1 - epochs_kept) * 1_000_000)
        if epoch >= epochs_kept:
            worst = max(worst, w.nbytes / (len(w) * DT.itemsize))
        check_blocks(w)
    assert 1.0 <= worst <= 2.0
