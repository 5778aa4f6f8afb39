"""The randomized differential matrix in CI: a fixed set of draws (tests.matrix.covering_seeds) that covers
every pair of feature values the configuration accepts, each run on the real cluster and compared with the
independent reference join over its whole input (file, declared streams, Kafka topics, and live ZeroMQ input
pushed by producers that resend after a crash).  `make soak` runs random draws for as long as it is given."""

from __future__ import annotations

import itertools

import pytest

from tests.matrix import PAIRED, covering_seeds, draw, refusal, run_draw

SEEDS = covering_seeds()


def test_the_seeds_cover_every_pair_of_feature_values_the_engine_accepts():
    def pairs(seed):
        f = draw(seed).features()
        return {((a, f[a]), (b, f[b])) for a, b in itertools.combinations(PAIRED, 2)}

    accepted = set().union(*(pairs(s) for s in range(2000) if refusal(draw(s)) is None))
    covered = set().union(*(pairs(s) for s in SEEDS))
    assert accepted - covered == set()
    assert all(refusal(draw(s)) is None for s in SEEDS)
    chosen = [draw(s) for s in SEEDS]  # among the pairs: live input pushed by producers beside the cluster
    assert any(d.input == "zmq" and d.crash for d in chosen)
    assert any(d.input == "live-streams" and d.dispatchers == 2 for d in chosen)
    assert any(d.input == "live-streams" and (d.hotkeys or d.predicate == "band") for d in chosen)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_drawn_configuration_gives_exactly_the_reference_result(tmp_path, seed, request):
    d = draw(seed)
    outcome = run_draw(d, tmp_path, spark=request.getfixturevalue("spark") if d.aggregate or d.replay else None)
    assert outcome.ok, f"{outcome.line()}\n  reproduce: python -m tests.matrix --seed {seed} --keep"
    assert outcome.expected > 0


def test_a_check_that_breaks_is_its_draws_failure_and_the_soak_goes_on(monkeypatch, capsys):
    """An exception inside one draw's checks is reported as that draw's failure, with its seed, and the other
    draws still run."""
    from tests import matrix

    seeds = [s for s in covering_seeds() if not refusal(draw(s))][:2]

    def checks(d, tmp, **_):
        if d.seed == seeds[0]:
            raise KeyError("a column the check expected")
        return matrix.Outcome(d)

    monkeypatch.setattr(matrix, "run_draw", checks)
    args = [a for s in seeds for a in ("--seed", str(s))]
    assert matrix.main(args) == 1
    out = capsys.readouterr().out
    assert f"failed: seed {seeds[0]}" in out and f"failed: seed {seeds[1]}" not in out, out
    assert "KeyError in the draw's checks" in out and "2 draws: 2 run" in out, out
