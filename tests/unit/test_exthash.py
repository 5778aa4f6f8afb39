"""Tests of slave/exthash.py: the extendible-hash directory and partition-group tuning."""

from __future__ import annotations

import signal
from collections import Counter

import numpy as np
import pytest

from protocol.tuples import directory_hash, tuple_dtype
from slave.exthash import ExtendibleDirectory, PartitionGroup

DT = tuple_dtype(40)


@pytest.fixture
def time_limit():
    """Fail instead of hanging if tuning loops forever."""

    def boom(signum, frame):
        raise TimeoutError("tune() did not return within 10 s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------- directory


def check_directory(d: ExtendibleDirectory):
    g = d.global_depth
    assert len(d.entries) == 2**g
    assert set(d.entries.tolist()) == set(d.local_depth)
    assert g == max(d.local_depth.values()), "global depth larger than any bucket needs"
    idx = np.arange(len(d.entries))
    for b, ld in d.local_depth.items():
        assert 0 <= ld <= g
        mine = idx[d.entries == b]
        assert len(mine) == 2 ** (g - ld)
        assert len(set((mine & ((1 << ld) - 1)).tolist())) == 1, f"bucket {b}: entries disagree in low {ld} bits"


def pattern(d: ExtendibleDirectory, b: int) -> int:
    ld = d.local_depth[b]
    return int(np.flatnonzero(d.entries == b)[0]) & ((1 << ld) - 1)


def test_split_at_global_depth_doubles():
    d = ExtendibleDirectory()
    new, bit = d.split(0)
    assert (new, bit) == (1, 0)
    assert d.global_depth == 1 and d.entries.tolist() == [0, 1]
    assert d.local_depth == {0: 1, 1: 1}
    new, bit = d.split(1)
    assert bit == 1 and d.global_depth == 2 and len(d.entries) == 4
    assert d.entries.tolist() == [0, 1, 0, new]
    assert d.local_depth == {0: 1, 1: 2, new: 2}
    check_directory(d)


def test_split_below_global_depth_does_not_double():
    d = ExtendibleDirectory()
    d.split(0)
    n2, _ = d.split(0)  # bucket 0 at global depth: doubles to 4 entries
    assert d.global_depth == 2 and len(d.entries) == 4
    check_directory(d)
    assert d.local_depth[1] == 1 < d.global_depth
    new, bit = d.split(1)
    assert bit == 1
    assert d.global_depth == 2 and len(d.entries) == 4
    assert d.entries.tolist() == [0, 1, n2, new]
    check_directory(d)


def test_bucket_of_uses_low_global_depth_bits():
    d = ExtendibleDirectory()
    h = np.array([0, 1, 2, 3, 4, 5, 6, 7, 2**31 + 3], dtype=np.uint64)
    assert d.bucket_of(h).tolist() == [0] * 9
    d.split(0)
    d.split(0)
    np.testing.assert_array_equal(d.bucket_of(h), d.entries[(h % 4).astype(np.int64)])


@pytest.mark.parametrize("seed", range(25))
def test_random_splits_and_merges_keep_invariant(seed):
    rng = np.random.default_rng(seed)
    d = ExtendibleDirectory()
    for step in range(120):
        check_directory(d)
        buckets = list(d.local_depth)
        if rng.random() < 0.55 and d.global_depth < 7:
            b = int(rng.choice(buckets))
            g0, ld0, pat0 = d.global_depth, d.local_depth[b], pattern(d, b)
            new, bit = d.split(b)
            assert bit == ld0 and new not in buckets
            assert d.global_depth == (g0 + 1 if ld0 == g0 else g0)
            assert d.local_depth[b] == d.local_depth[new] == ld0 + 1
            assert pattern(d, b) == pat0 and pattern(d, new) == pat0 | (1 << ld0)
        else:
            pairs = [(b, d.buddy(b)) for b in buckets]
            pairs = [(b, o) for b, o in pairs if o is not None]
            for b in buckets:  # buddy is None exactly when no same-depth sibling exists
                ld = d.local_depth[b]
                sib = [
                    o
                    for o in buckets
                    if o != b and d.local_depth[o] == ld and ld > 0 and pattern(d, o) == pattern(d, b) ^ (1 << (ld - 1))
                ]
                assert d.buddy(b) == (sib[0] if sib else None)
            if not pairs:
                continue
            b, o = pairs[int(rng.integers(len(pairs)))]
            assert d.buddy(o) == b
            ld0, old_entries = d.local_depth[b], d.entries.copy()
            d.merge(b, o)
            assert o not in d.local_depth and d.local_depth[b] == ld0 - 1
            # every hash that went to b or o now goes to b; all others unchanged
            g = d.global_depth
            for i, e in enumerate(old_entries.tolist()):
                now = int(d.entries[i & ((1 << g) - 1)])
                assert now == (b if e in (b, o) else e)
    check_directory(d)


def test_merge_halves_directory_when_possible():
    d = ExtendibleDirectory()
    d.split(0)
    n2, _ = d.split(0)
    n3, _ = d.split(n2)
    assert d.global_depth == 3 and len(d.entries) == 8
    d.merge(n2, n3)
    assert d.global_depth == 2 and len(d.entries) == 4
    check_directory(d)
    d.merge(0, n2)
    assert d.global_depth == 1 and d.entries.tolist() == [0, 1]
    d.merge(0, 1)
    assert d.global_depth == 0 and d.entries.tolist() == [0] and d.local_depth == {0: 0}
    assert d.buddy(0) is None


def test_merge_does_not_halve_while_a_bucket_needs_top_bit():
    d = ExtendibleDirectory()
    d.split(0)
    d.split(0)  # 0 and n at depth 2, 1 at depth 1
    d.split(1)  # 1 and m at depth 2
    assert d.global_depth == 2
    d.merge(0, d.buddy(0))
    assert d.global_depth == 2 and len(d.entries) == 4
    check_directory(d)


# --------------------------------------------------------------------------- partition group


def rows(stream_ids, keys, ts):
    out = np.zeros(len(stream_ids), dtype=DT)
    out["id"], out["key"], out["ts"] = stream_ids, keys, ts
    return out


def insert(pg: PartitionGroup, r: np.ndarray, s: np.ndarray):
    """Route like slave/join.py: directory bucket of the key's directory hash."""
    for side, new in ((0, r), (1, s)):
        b = pg.directory.bucket_of(directory_hash(new["key"]))
        for bucket in np.unique(b).tolist():
            pg.buckets[bucket][side].append(new[b == bucket])


def stored(pg: PartitionGroup) -> Counter:
    return Counter(
        (side, i) for wins in pg.buckets.values() for side, w in enumerate(wins) for i in w.rows["id"].tolist()
    )


def check_group(pg: PartitionGroup):
    check_directory(pg.directory)
    assert set(pg.buckets) == set(pg.directory.local_depth)
    assert pg.directory.global_depth <= pg.max_depth
    for b, wins in pg.buckets.items():
        for w in wins:
            if len(w):
                routed = pg.directory.bucket_of(directory_hash(w.rows["key"]))
                assert np.all(routed == b), f"tuples stored in bucket {b} route elsewhere"
            B = w.block_size
            ts = w.rows["ts"]
            np.testing.assert_array_equal(w.block_max, [ts[i : i + B].max() for i in range(0, len(ts), B)])


def tune_until_stable(pg: PartitionGroup, limit=50):
    for _ in range(limit):
        before = (pg.splits, pg.merges)
        pg.tune()
        check_group(pg)
        if (pg.splits, pg.merges) == before:
            return
    raise AssertionError("tuning never settled")


def splittable(pg: PartitionGroup, b: int) -> bool:
    keys = np.concatenate([w.rows["key"] for w in pg.buckets[b]])
    h = directory_hash(keys)
    return pg.directory.local_depth[b] < pg.max_depth and h.min() != h.max()


@pytest.mark.parametrize("seed", range(4))
def test_group_splits_then_merges_keep_every_tuple_once(seed, time_limit):
    rng = np.random.default_rng(seed)
    pg = PartitionGroup(DT, block_size=4, theta_min=2, theta_max=6, max_depth=10)
    n = 1500
    keys = rng.integers(0, 300, 2 * n) ** 2  # spread keys; also a skewed head below
    keys[rng.random(2 * n) < 0.1] = 7
    ts = rng.uniform(0, 100, 2 * n)
    r, s = rows(np.arange(n), keys[:n], ts[:n]), rows(np.arange(n), keys[n:], ts[n:])
    for part in np.array_split(np.arange(n), 5):  # several inserts, tuning in between
        insert(pg, r[part], s[part])
        before = stored(pg)
        pg.tune()
        check_group(pg)
        assert stored(pg) == before
    assert stored(pg) == Counter([(0, i) for i in range(n)] + [(1, i) for i in range(n)])
    tune_until_stable(pg)
    assert pg.splits > 10 and pg.merges == 0
    assert pg.directory.global_depth >= 3
    for b in pg.buckets:
        assert pg.bucket_blocks(b) <= pg.theta_max or not splittable(pg, b)
    depth_before, buckets_before = pg.directory.global_depth, len(pg.buckets)

    # expire most tuples: keep only ts >= 97 (whole blocks whose newest ts is >= 97 survive)
    dropped = pg.expire((97.0, 97.0))
    left = stored(pg)
    assert dropped == 2 * n - sum(left.values())
    assert sum(left.values()) < 0.5 * 2 * n
    survivors = {(side, i) for side, arr in ((0, r), (1, s)) for i in arr["id"][arr["ts"] >= 97.0].tolist()}
    assert survivors <= set(left), "expire dropped a tuple with ts >= threshold"
    tune_until_stable(pg)
    assert stored(pg) == left
    assert pg.merges > 0
    assert len(pg.buckets) < buckets_before and pg.directory.global_depth <= depth_before

    # expire everything: merging collapses the directory back down
    pg.expire((1e9, 1e9))
    tune_until_stable(pg)
    assert len(pg) == 0
    assert pg.directory.global_depth == 0 and len(pg.buckets) == 1


def test_single_hot_key_is_never_split(time_limit):
    pg = PartitionGroup(DT, block_size=2, theta_min=1, theta_max=3, max_depth=8)
    n = 500
    insert(
        pg,
        rows(np.arange(n), np.full(n, 42), np.arange(n, dtype=float)),
        rows(np.arange(n), np.full(n, 42), np.arange(n, dtype=float)),
    )
    pg.tune()
    pg.tune()
    assert pg.splits == 0 and pg.directory.global_depth == 0
    assert pg.bucket_blocks(0) == 2 * (n // 2)
    assert len(pg) == 2 * n
    check_group(pg)


def test_hot_keys_sharing_low_bits_stop_at_max_depth(time_limit):
    max_depth = 5
    # two keys whose directory hashes agree on the low max_depth bits but differ above
    cand = np.arange(1, 5000)
    h = directory_hash(cand)
    low = (h & np.uint64((1 << max_depth) - 1)).astype(np.int64)
    k1 = int(cand[0])
    k2 = int(cand[1:][(low[1:] == low[0]) & (h[1:] != h[0])][0])
    pg = PartitionGroup(DT, block_size=2, theta_min=1, theta_max=3, max_depth=max_depth)
    n = 200
    keys = np.where(np.arange(n) % 2 == 0, k1, k2)
    insert(pg, rows(np.arange(n), keys, np.zeros(n)), rows(np.arange(n), keys[::-1], np.zeros(n)))
    before = stored(pg)
    for _ in range(max_depth + 3):
        pg.tune()
        check_group(pg)
    assert pg.directory.global_depth <= max_depth
    assert stored(pg) == before
    full = [b for b in pg.buckets if len(pg.buckets[b][0]) + len(pg.buckets[b][1])]
    assert len(full) == 1  # both keys are still together: no depth up to max_depth separates them
    assert pg.directory.local_depth[full[0]] == max_depth
    splits = pg.splits
    pg.tune()
    assert pg.splits == splits  # at max depth nothing more happens


def test_hot_key_with_a_few_others_splits_the_others_off(time_limit):
    pg = PartitionGroup(DT, block_size=2, theta_min=1, theta_max=4, max_depth=12)
    n = 300
    keys = np.full(n, 99)
    keys[::10] = np.arange(1000, 1000 + len(keys[::10]))
    insert(pg, rows(np.arange(n), keys, np.zeros(n)), rows(np.arange(0), keys[:0], np.zeros(0)))
    tune_until_stable(pg)
    assert pg.splits > 0 and pg.directory.global_depth <= 12
    hot = pg.directory.bucket_of(directory_hash(np.array([99])))[0]
    assert set(pg.buckets[hot][0].rows["key"].tolist()) == {99}
    assert stored(pg) == Counter((0, i) for i in range(n))


def test_max_depth_zero_turns_tuning_off(time_limit):
    # tuning.max_depth = 0: one bucket per partition-group however large (the bench's "tuning off")
    pg = PartitionGroup(DT, block_size=2, theta_min=1, theta_max=3, max_depth=0)
    n = 400
    insert(pg, rows(np.arange(n), np.arange(n), np.zeros(n)), rows(np.arange(n), np.arange(n)[::-1], np.zeros(n)))
    pg.tune()
    assert pg.splits == 0 and list(pg.buckets) == [0] and pg.bucket_blocks(0) == n
    check_group(pg)
