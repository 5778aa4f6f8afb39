"""Pure logic of balancing: classification, group choice, the plan, the controller's bookkeeping, and the
state mover's round trip (a moved group keeps its extendible-hash splits and every tuple)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from master.state.balance import Move, choose_group, classify, plan
from master.state.controller import Controller
from protocol.plan import load_plan
from protocol.tuples import directory_hash, tuple_dtype
from slave.join import JoinModule
from protocol.eventtime import NEG_INF, POS_INF
from slave.mover import decode_move, encode_move

BAL = load_plan(
    None,
    [
        "balance.supplier_threshold=0.5",
        "balance.consumer_threshold=0.1",
        "balance.gamma=2.0",
        'balance.choice="largest_fit"',
        "balance.declustering=true",
    ],
).balance


def test_classify_orders_suppliers_and_consumers():
    s, c = classify({1: 0.9, 2: 0.05, 3: 0.3, 4: 0.7, 5: 0.0}, 0.5, 0.1)
    assert s == [1, 4] and c == [5, 2]


def test_largest_fit_never_swaps_the_overload():
    rng = np.random.default_rng(0)
    groups = {1: 50.0, 2: 30.0, 3: 10.0}
    # supplier 90, consumer 20: moving g leaves supplier 90-g >= consumer 20+g iff g <= 35
    assert choose_group(groups, 90.0, 20.0, "largest_fit", rng) == 2
    assert choose_group({1: 80.0}, 90.0, 20.0, "largest_fit", rng) is None
    assert choose_group({}, 90.0, 20.0, "random", rng) is None
    picks = {choose_group(groups, 90.0, 20.0, "random", np.random.default_rng(i)) for i in range(50)}
    assert picks == {1, 2, 3}


def test_largest_fit_weighs_tuples_by_each_slaves_cost_per_tuple():
    """A busy host: the supplier has no more tuples than the consumer but joins each 3x slower."""
    rng = np.random.default_rng(0)
    groups = {1: 25.0, 2: 20.0, 3: 10.0}
    assert choose_group(groups, 60.0, 60.0, "largest_fit", rng) is None  # by tuples alone nothing fits
    # work time: supplier 60 * 3 = 180, consumer 60 * 1 = 60; g fits iff 60 + g <= 180 - 3g, i.e. g <= 30
    assert choose_group(groups, 60.0, 60.0, "largest_fit", rng, supplier_cost=3.0, consumer_cost=1.0) == 1
    assert choose_group(groups, 60.0, 60.0, "largest_fit", rng, supplier_cost=1.5, consumer_cost=1.0) == 3  # g <= 12
    # equal costs are the tuple rule, whatever the unit
    wide = {1: 40.0, 2: 30.0, 3: 10.0}
    assert (
        choose_group(wide, 90.0, 20.0, "largest_fit", rng, 2e-6, 2e-6)
        == choose_group(wide, 90.0, 20.0, "largest_fit", rng)
        == 2
    )  # g <= 35


def test_plan_uses_measured_costs_and_the_median_for_slaves_without_one():
    occ = {1: 0.9, 2: 0.0, 3: 0.0}
    loads = {1: {10: 25.0, 11: 35.0}, 2: {12: 30.0, 13: 30.0}, 3: {14: 30.0, 15: 30.0}}
    bal = replace(BAL, declustering=False)
    assert plan(occ, loads, [], bal, np.random.default_rng(0)) == ([], None, None)
    moves, _, _ = plan(occ, loads, [], bal, np.random.default_rng(0), cost={1: 3e-6, 2: 1e-6, 3: 1e-6})
    assert moves == [Move(10, 1, 2, "balance")]  # room (180 - 60) / 4 = 30 work units: 25 fits, 35 does not
    # consumer 2 unmeasured: the median of {3e-6, 1e-6} (the upper one) = 3e-6, as slow as the supplier
    assert plan(occ, loads, [], bal, np.random.default_rng(0), cost={1: 3e-6, 3: 1e-6}) == ([], None, None)


def test_plan_shrinks_the_busiest_host_first_not_the_idlest_slave():
    """Measured in the balance bench: with the least loaded slave leaving, the quiet hosts' slaves left one by
    one and the slave on the busy host ended up with every group."""
    occ = {1: 0.0, 2: 0.05, 3: 0.3}
    loads = {1: {10: 40.0}, 2: {11: 30.0}, 3: {12: 5.0, 13: 3.0}}
    _, _, leaving = plan(occ, loads, [], BAL, np.random.default_rng(0), cost={1: 1e-6, 2: 1e-6, 3: 3e-6})
    assert leaving == 3
    # costs within noise (less than 5% of the typical apart): the least loaded slave leaves, as in the paper
    _, _, leaving = plan(occ, loads, [], BAL, np.random.default_rng(0), cost={1: 1.01e-6, 2: 1e-6, 3: 1.02e-6})
    assert leaving == 1


def test_plan_pairs_each_supplier_with_one_consumer():
    occ = {1: 0.9, 2: 0.8, 3: 0.0, 4: 0.05, 5: 0.3}
    loads = {1: {10: 40.0, 11: 50.0}, 2: {12: 30.0, 13: 50.0}, 3: {14: 1.0}, 4: {15: 2.0}, 5: {16: 20.0}}
    moves, joining, leaving = plan(occ, loads, [], BAL, np.random.default_rng(0))
    assert joining is None and leaving is None
    assert moves == [Move(10, 1, 3, "balance"), Move(12, 2, 4, "balance")]


def test_plan_grows_when_suppliers_outnumber_gamma_times_consumers():
    occ = {1: 0.9, 2: 0.8, 3: 0.3}
    loads = {1: {10: 40.0, 11: 50.0}, 2: {12: 30.0, 13: 50.0}, 3: {14: 20.0}}
    moves, joining, leaving = plan(occ, loads, [7, 8], BAL, np.random.default_rng(0))
    assert joining == 7 and leaving is None
    assert moves[0] == Move(10, 1, 7, "grow")  # the largest group that fits: 40 <= (90 - 0) / 2 < 50


def test_plan_shrinks_without_suppliers_and_hands_over_every_group():
    occ = {1: 0.3, 2: 0.2, 3: 0.05}
    loads = {1: {10: 40.0}, 2: {11: 30.0}, 3: {12: 5.0, 13: 3.0, 14: 1.0}}
    moves, joining, leaving = plan(occ, loads, [], BAL, np.random.default_rng(0))
    assert leaving == 3 and joining is None
    assert sorted(m.partition for m in moves) == [12, 13, 14]
    assert all(m.supplier == 3 and m.consumer in (1, 2) and m.reason == "shrink" for m in moves)
    assert plan({1: 0.3}, {1: {10: 1.0}}, [], BAL, np.random.default_rng(0)) == ([], None, None)
    assert plan(occ, loads, [], replace(BAL, declustering=False), np.random.default_rng(0)) == ([], None, None)


def controller(**balance):
    settings = [f"balance.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in balance.items()]
    return Controller(load_plan(None, settings).balance, [1, 2, 3, 4], 8)


def test_controller_measures_cost_per_tuple_per_reorganization_epoch():
    c = controller()
    c.on_work(1, 1000, 0.002)
    c.on_work(1, 3000, 0.006)
    c.on_work(2, 0, 0.001)  # a punctuation-only batch: no cost
    c.on_work(3, 500, 0.004)
    assert c.cost() == pytest.approx({1: 2e-6, 3: 8e-6})
    c.reorganize(0.0)
    assert c.occupancy_log[-1]["us_per_tuple"] == {1: 2.0, 3: 8.0}
    assert set(c.occupancy_log[-1]["occupancy"]) == {1, 2, 3, 4}
    assert c.cost() == {}  # a new epoch starts empty


def test_controller_runs_a_move_to_completion_and_retires_an_empty_slave():
    c = controller(initial_slaves=2, buffer_capacity=100, supplier_threshold=0.5, consumer_threshold=0.5)
    assert c.active == [1, 2] and c.inactive == [3, 4]
    assert set(c.partition_map.tolist()) == {1, 2}
    c.on_batch(c.partitions_of(1), np.array([100, 100, 100, 100]))
    c.on_batch(c.partitions_of(2), np.array([1, 1, 1, 1]))
    c.on_slot(1, 300), c.on_slot(1, 100), c.on_slot(2, 0), c.on_slot(2, 0)
    assert c.occupancy() == {1: 2.0, 2: 0.0}
    c.reorganize(now=1.0)
    assert len(c.queue) == 1 and c.queue[0].supplier == 1 and c.queue[0].consumer == 2
    assert c.next_orders(lambda r: False, {1: 5_000_000}.get, 1.0) == []  # supplier busy: nothing starts
    assert c.watermark_cap() == POS_INF
    (move,) = c.next_orders(lambda r: True, {1: 5_000_000}.get, 1.0)
    assert c.watermark_cap() == 5_000_000  # the watermark of the supplier's last batch: older tuples are held
    assert c.moving[move.partition] and move.partition not in c.partitions_of(1).tolist()
    assert move.partition not in c.partitions_of(2).tolist()  # held at the master until installed
    c.on_installed(move.partition, 42, now=2.0)
    assert c.partition_map[move.partition] == 2 and not c.moving.any() and not c.busy
    assert c.watermark_cap() == POS_INF
    assert c.moves_log[0]["tuples_moved"] == 42 and c.moves_log[0]["from"] == 1


def test_controller_disabled_never_plans():
    c = controller(enabled=False, buffer_capacity=1, supplier_threshold=0.5, consumer_threshold=0.5)
    c.on_slot(1, 1000)
    c.reorganize(now=1.0)
    assert c.queue == [] and c.active == [1, 2, 3, 4]


@pytest.mark.parametrize("seed", range(5))
def test_state_round_trip_keeps_splits_and_every_tuple(seed):
    rng = np.random.default_rng(seed)
    dt = tuple_dtype(64)
    module = JoinModule(dt, 1, (-500_000, 500_000), 4, 1, 4, 10)
    for epoch in range(6):
        batch = np.zeros(400, dt)
        batch["id"] = np.arange(400) + 400 * epoch
        batch["key"] = rng.integers(0, 300, 400)
        batch["ts"] = (epoch + rng.random(400)) * 1_000_000
        module.process(batch[:200], batch[200:], watermark=(epoch - 5) * 1_000_000)
    pg = module.extract(0)
    assert pg.directory.global_depth > 0 and len(pg.buckets) > 1
    floor = NEG_INF if seed == 0 else seed * 1_000_000 - 2_500_001  # the consumer's punctuation floor travels along
    partition, copy, got_floor = decode_move(encode_move(0, pg, floor), module.new_group)
    assert partition == 0 and got_floor == floor
    assert copy.directory.global_depth == pg.directory.global_depth
    assert np.array_equal(copy.directory.entries, pg.directory.entries)
    assert copy.directory.local_depth == pg.directory.local_depth
    for b, (r, s) in pg.buckets.items():
        r2, s2 = copy.buckets[b]
        assert np.array_equal(r.rows, r2.rows) and np.array_equal(s.rows, s2.rows)
        assert np.array_equal(r.block_max, r2.block_max)
        routed = copy.directory.bucket_of(directory_hash(np.concatenate([r2.rows["key"], s2.rows["key"]])))
        assert (routed == b).all()
    assert len(copy) == len(pg) > 0
    # the installed copy keeps joining and splitting like the original
    module.install(0, copy)
    with pytest.raises(ValueError, match="already installed"):
        module.install(0, copy)


def test_a_move_waits_until_its_consumer_has_no_batch_in_flight():
    # a batch already on its way to the consumer carries an uncapped watermark; if the group's state overtook
    # it, the consumer would expire installed blocks the held tuples still need (seen: pairs lost in 1 of 8 runs)
    c = Controller(load_plan().balance, [1, 2, 3], 6)
    c.queue.append(Move(0, 1, 2, "balance"))
    busy = {2}
    assert c.next_orders(lambda r: r not in busy, lambda r: 0.0, 1.0) == []
    busy.clear()
    assert c.next_orders(lambda r: r not in busy, lambda r: 0.0, 1.0) == [Move(0, 1, 2, "balance")]
