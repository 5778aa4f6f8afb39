"""bench.failover's figures of a nemesis soak's record (tests.nemesis --record): faults an hour, the seconds from
each fault to the first new result by kind (median, max, and faults after which none came), results lost and
each rank's peak resident memory."""

from __future__ import annotations

from bench.failover import nemesis_figures, nemesis_text

MiB = 2**20


def record(lost_pairs: int = 0) -> dict:
    faults = [
        {"at": 20.0, "fault": "kill-slave", "hit": "rank 2", "first_result_s": 6.0},
        {"at": 50.0, "fault": "kill-slave", "hit": "rank 3", "first_result_s": 10.0},
        {"at": 80.0, "fault": "kill-master", "hit": "rank 0", "first_result_s": 12.5},
        {"at": 110.0, "fault": "pause-broker", "hit": "for 4.0s", "first_result_s": None},
    ]
    return {
        "seed": 7,
        "minutes": 3,
        "faults": faults,
        "restarts": 3,
        "lost": {
            "files": {"pairs": lost_pairs, "views alone": 0},
            "sink (read_committed)": {"pairs": 0, "views alone": 0},
        },
        "sampled_seconds": 180.0,
        "resources": {
            "rss master (rank 0)": {"thirds": [1, 2, 3], "peak": 250 * MiB, "failure": None},
            "rss slave (rank 2)": {"thirds": [1, 2, 3], "peak": 130 * MiB, "failure": None},
            "fds master (rank 0)": {"thirds": [1, 2, 3], "peak": 45, "failure": None},
        },
        "failures": [],
        "ok": True,
    }


def test_the_figures_of_a_soak_s_record():
    n = nemesis_figures(record())
    assert n["faults"] == 4 and n["faults_per_hour"] == 80.0
    assert n["first_result_s"]["kill-slave"] == {"n": 2, "median": 8.0, "max": 10.0, "none": 0}
    assert n["first_result_s"]["pause-broker"] == {"n": 1, "median": None, "max": None, "none": 1}
    assert n["results_lost"] == 0 and n["resources_flat"]
    assert n["peak_rss_mib"] == {"master (rank 0)": 250.0, "slave (rank 2)": 130.0}
    text = nemesis_text(n)
    assert "results lost 0 (target 0: met)" in text and "| kill-master" in text


def test_a_result_lost_misses_the_target():
    n = nemesis_figures(record(lost_pairs=3))
    assert n["results_lost"] == 3 and "MISSED" in nemesis_text(n)
