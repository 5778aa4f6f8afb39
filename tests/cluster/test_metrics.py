"""The metrics endpoint, the metrics log and the dashboard (master/metrics.py, common/dashboard.py,
control/dashboard.py), scraped from real paced clusters; the page read by a real headless Chromium."""

from __future__ import annotations

import contextlib
import json
import math
from collections import Counter
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.launch import mpi_env, mpirun_command
from master.metrics import BUCKET_EDGES, _histogram
from protocol import delays
from protocol.config import ConfigError, load_config
from tests.runs import free_port, run_cluster, write_config

#: a paced run long enough to be scraped a few times: 6,000 tuples/s for 6 s, a sample a second, with checkpoints
PACED = {
    "generator.duration": 6.0,
    "generator.rate": 3000.0,
    "generator.keys": 4096,
    "source.rate": 6000.0,
    "join.window": 0.5,
    "join.max_delay": 0.2,
    "generator.disorder": 0.1,
    "epochs.distribution": 0.1,
    "checkpoint.interval": 10,
    "metrics.log_interval": 1.0,
}
COUNTERS = (
    "streamjoin_input_tuples_total",
    "streamjoin_results_total",
    "streamjoin_slave_busy_seconds_total",
    "streamjoin_slave_joined_tuples_total",
    "streamjoin_checkpoints_total",
    "streamjoin_delay_seconds_count",
)


def parse(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a Prometheus exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def scrape(port: int) -> dict[tuple, float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return parse(r.read().decode())
    except OSError:
        return None


def total(metrics: dict, name: str) -> float:
    return sum(v for (n, _), v in metrics.items() if n == name)


def start(tmp: Path, settings: dict, ranks: int) -> subprocess.Popen:
    cfg = write_config(tmp, settings)
    return subprocess.Popen(
        mpirun_command(ranks, ["--config", str(cfg)]), env=mpi_env(), stderr=subprocess.PIPE, text=True
    )


def scrape_until_done(proc: subprocess.Popen, port: int, every: float = 0.5) -> list[dict]:
    scrapes, deadline = [], time.monotonic() + 240
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the paced run did not end"
        got = scrape(port)
        if got and total(got, "streamjoin_input_tuples_total") > 0:
            scrapes.append(got)
        time.sleep(every)
    return scrapes


def check_final(out: Path, summary: dict) -> dict:
    """metrics.prom and the log's last sample agree with summary.json; returns the final metrics."""
    final = parse((out / "metrics.prom").read_text())
    for stream in ("R", "S"):
        assert (
            sum(
                v
                for (n, labels), v in final.items()
                if n == "streamjoin_input_tuples_total" and ("stream", stream) in labels
            )
            == summary["input"][stream]
        )
    assert total(final, "streamjoin_rejected_total") == summary["rejected"]
    for reason, n in Counter(m["reason"] for m in summary["balance"]["moves"]).items():
        assert final[("streamjoin_moves_total", (("reason", reason),))] == n
    assert total(final, "streamjoin_moves_total") == len(summary["balance"]["moves"])
    assert final[("streamjoin_moved_tuples_total", ())] == summary["tuples_moved"]
    for event in ("split", "merge"):
        assert final[("streamjoin_hot_key_events_total", (("event", event),))] == sum(
            e["event"] == event for e in summary["hot_keys"]
        )
    assert final[("streamjoin_results_total", ())] == summary["results"]
    assert final[("streamjoin_late_tuples_total", ())] == summary["late"]
    assert final[("streamjoin_delay_seconds_count", ())] == summary["results"]  # one delay per result
    assert final[("streamjoin_checkpoints_total", ())] == summary["checkpoints"]["written"]
    for rank, s in summary["slaves"].items():
        assert final[("streamjoin_slave_joined_tuples_total", (("slave", rank),))] == s["tuples_processed"]
        assert final[("streamjoin_slave_busy_seconds_total", (("slave", rank),))] == pytest.approx(s["busy_seconds"])
        assert final[("streamjoin_slave_window_tuples", (("slave", rank),))] == s["window_tuples"]
    log = pq.read_table(out / "metrics").to_pylist()
    last = max(log, key=lambda r: r["time"])
    assert last["input_r"] + last["input_s"] == summary["input_total"] and last["results"] == summary["results"]
    return final


def test_delay_histogram_buckets_count_the_delays_at_or_below_each_edge():
    rng = np.random.default_rng(3)
    values = np.concatenate([10 ** rng.uniform(-7, 5, 5000), [0.5, 0.5, 1e-6]])
    fam = _histogram("delay_seconds", "d", [((), delays.histogram(values))])
    buckets = {float(s.labels["le"]): s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert len(buckets) == len(BUCKET_EDGES) + 1 and buckets[math.inf] == len(values)
    for edge in BUCKET_EDGES:  # a bin holds [lower edge, upper edge): at an edge the count is of values below it
        assert buckets[float(edge)] == np.count_nonzero(values < edge)
    count = next(s.value for s in fam.samples if s.name.endswith("_count"))
    total_delay = next(s.value for s in fam.samples if s.name.endswith("_sum"))
    # _sum is estimated from the bins (their geometric middles; the open ends at their edge): within a bin's width
    assert count == len(values) and total_delay == pytest.approx(np.clip(values, 1e-6, 1e4).sum(), rel=0.07)


def test_rejected_file_rows_are_counted_by_reason_with_duplicates_as_one_reason(tmp_path):
    from master.metrics import rejected_reasons
    from master.sources import RejectedListing
    from tests.runs import file_source

    (tmp_path / "in.csv").write_text(
        "stream,id,ts,key\nR,1,0.1,5\nX,2,0.2,5\nS,3,oops,5\nR,1,0.3,5\nR,1,0.4,5\nS,4,0.5,x\n"
    )
    listing = RejectedListing(tmp_path / "rejected", "parquet", 100)
    source = file_source(tmp_path / "in.csv", listing=listing)
    while source.next_chunk(100) is not None:  # rows are counted as the run passes them
        pass
    assert rejected_reasons(source) == {
        "stream is not R or S": 1,
        "ts is not a number or an ISO-8601 time": 1,
        "duplicate id": 2,
        "key is not an integer": 1,
    }
    assert sum(rejected_reasons(source).values()) == source.finish()["rejected"] == 5


@pytest.mark.parametrize(
    "endpoint,allow,needle",
    [
        ("0.0.0.0:9464", False, "not a loopback address"),
        ("127.0.0.1", False, "expected HOST:PORT"),
        ("127.0.0.1:http", False, "expected HOST:PORT"),
        ("tcp://127.0.0.1:9464", False, "expected HOST:PORT"),
    ],
)
def test_metrics_endpoint_is_checked_like_the_other_endpoints(endpoint, allow, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [f'metrics.endpoint="{endpoint}"', f"security.allow_remote={str(allow).lower()}"])
    assert load_config(None, ['metrics.endpoint="0.0.0.0:9464"', "security.allow_remote=true"])
    assert load_config(None, ['metrics.endpoint=""'])["metrics"]["endpoint"] == ""


def test_a_taken_metrics_port_stops_the_run_before_it_starts_naming_the_key(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            mpirun_command(3, ["--config", str(write_config(tmp_path, {"metrics.endpoint": f"127.0.0.1:{port}"}))]),
            env=mpi_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2 and f"metrics.endpoint '127.0.0.1:{port}': cannot serve there" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "summary.json").exists()


def test_scraped_counters_rise_during_a_paced_run_and_agree_with_the_summary(tmp_path):
    port = free_port()
    proc = start(tmp_path, {**PACED, "metrics.endpoint": f"127.0.0.1:{port}", "output.progress": 1.0}, 3)
    scrapes = scrape_until_done(proc, port)
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    # the progress names where the output goes at the start; the last line names the summary, results, dashboard
    lines = stderr.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("output: "))
    assert first < next(i for i, line in enumerate(lines) if line.startswith("[")), stderr
    assert (
        lines[first].startswith(f"output: {out.resolve()}/") and f"dashboard http://127.0.0.1:{port}/" in lines[first]
    )
    out = out.resolve()
    last_line = lines[-1]
    assert str(out / "summary.json") in last_line and str(out / "results") in last_line
    assert f"python -m control.dashboard {out}" in last_line
    inputs = [total(s, "streamjoin_input_tuples_total") for s in scrapes]
    assert len(set(inputs)) >= 4, f"too few distinct scrapes during the run: {inputs}"
    for earlier, later in zip(scrapes, scrapes[1:]):
        for name in COUNTERS:
            assert total(later, name) >= total(earlier, name), name
    assert total(scrapes[-1], "streamjoin_results_total") > total(scrapes[0], "streamjoin_results_total")
    assert max(inputs) <= summary["input_total"]
    final = check_final(out, summary)
    # every live scrape is a sample of the log
    log = pq.read_table(out / "metrics").to_pylist()
    assert set(inputs) <= {r["input_r"] + r["input_s"] for r in log}
    assert total(final, "streamjoin_slave_joined_tuples_total") >= summary["input_total"]  # R copies count twice
    assert (
        summary["checkpoints"]["written"] >= 1
        and len(summary["checkpoints"]["log"]) == summary["checkpoints"]["written"]
    )


def test_a_stream_that_stops_is_shown_idle_while_the_other_flows(tmp_path):
    """streamjoin_stream_idle_seconds: S's input ends after the first of 4 s of paced input, R's goes on."""
    n = 12_000
    ts = np.arange(n) * (4.0 / n)
    stream = np.where((np.arange(n) % 2 == 0) | (ts >= 1.0), "R", "S")
    rows = "".join(f"{s},{i},{t:.6f},{i % 50},1.0\n" for i, (s, t) in enumerate(zip(stream, ts)))
    (tmp_path / "in.csv").write_text("stream,id,ts,key,value\n" + rows)
    run = run_cluster(
        tmp_path,
        3,
        {
            "source.kind": "file",
            "source.path": str(tmp_path / "in.csv"),
            "source.rate": n / 4.0,
            "join.window": 0.1,
            "metrics.log_interval": 1.0,
        },
    )
    assert run.returncode == 0, run.stderr[-2000:]
    final = parse((run.out / "metrics.prom").read_text())
    idle_r = final[("streamjoin_stream_idle_seconds", (("stream", "R"),))]
    idle_s = final[("streamjoin_stream_idle_seconds", (("stream", "S"),))]
    assert idle_s - idle_r >= 2.0, (idle_r, idle_s)  # S stopped 3 s of input before R
    # each stream's own watermark: its largest ts (S's below 1 s, R's near 4 s) minus join.max_delay
    wm = {st: final[("streamjoin_stream_watermark_seconds", (("dispatcher", "0"), ("stream", st)))] for st in "RS"}
    max_delay = load_config(None)["join"]["max_delay"]
    assert wm["S"] == pytest.approx(ts[stream == "S"].max() - max_delay, abs=1e-6)
    assert wm["R"] == pytest.approx(ts[stream == "R"].max() - max_delay, abs=1e-6)
    log = sorted(pq.read_table(run.out / "metrics").to_pylist(), key=lambda r: r["time"])
    assert max(r["idle_seconds_r"] for r in log[:-1]) < 2.0  # R rose at every sample while it flowed


def test_two_dispatchers_rank_0_serves_both_counters(tmp_path):
    port = free_port()
    proc = start(
        tmp_path,
        {**PACED, "cluster.dispatchers": 2, "metrics.endpoint": f"127.0.0.1:{port}", "checkpoint.interval": 0},
        4,
    )
    scrapes = scrape_until_done(proc, port)
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    # dispatcher 1's counters reach rank 0 again and again during the run: its watermark moves on
    wm1 = [s.get(("streamjoin_watermark_seconds", (("dispatcher", "1"),)), math.nan) for s in scrapes]
    assert len({w for w in wm1 if math.isfinite(w)}) >= 3, wm1
    check_final(tmp_path / "out", summary)


def test_moves_and_hot_keys_are_counted_as_the_summary_counts_them(tmp_path):
    from tests.cluster.test_hotkeys import HOT

    run = run_cluster(tmp_path, 4, {**HOT, "generator.duration": 4.0, "generator.seed": 1, "source.rate": 6000.0})
    assert run.returncode == 0, run.stderr
    assert run.summary["hot_keys"] and run.summary["balance"]["moves"]  # a grid was made and spread
    final = check_final(run.out, run.summary)
    log = pq.read_table(run.out / "metrics").to_pylist()
    assert any(row["hot_keys"] for row in log)  # the grid is in the log while it exists
    assert final[("streamjoin_reorganizations_total", ())] == run.summary["balance"]["reorganizations"]


# -- the page, in a real browser ------------------------------------------------------------------------------
def chromium() -> str:
    """The headless browser; installed with apt-get if missing (as root), else the test is skipped, saying why."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if (
        found is None
        and shutil.which("apt-get")
        and hasattr(__import__("os"), "geteuid")
        and __import__("os").geteuid() == 0
    ):
        subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, timeout=900)
        found = shutil.which("chromium")
    if found is None:
        reason = "headless Chromium not available: install Debian's `chromium` package (apt-get install chromium)"
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)
    return found


@contextlib.contextmanager
def dashboard_of(out: Path):
    """`control.dashboard` on a run's output folder; its page's URL."""
    port = free_port()
    viewer = subprocess.Popen(
        [sys.executable, "-m", "control.dashboard", str(out), "--endpoint", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "dashboard of" not in viewer.stderr.readline():
            assert viewer.poll() is None and time.monotonic() < deadline, "control.dashboard did not start"
        yield f"http://127.0.0.1:{port}/"
    finally:
        viewer.terminate()
        viewer.wait(timeout=30)


def browse(browser: str, url: str, *what: str, budget_ms: int = 4000) -> str:
    """Chromium headless on `url` for `budget_ms` of virtual time (the page's polls run), then `what`
    (--dump-dom prints the page as it is then, --screenshot=FILE saves it)."""
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1400,1500",
            f"--virtual-time-budget={budget_ms}",
            *what,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def shown(dom: str, element: str, attribute: str | None = None) -> str:
    """The text (or `attribute`) of the element with id `element` in a dumped page."""
    import re

    tag = re.search(rf'<[^>]*id="{element}"[^>]*>([^<]*)<', dom)
    assert tag, f"#{element} not on the page"
    if attribute is None:
        return tag.group(1)
    return re.search(rf'{attribute}="([^"]*)"', tag.group(0)).group(1)


def test_dashboard_in_headless_chromium_shows_the_metrics_live_and_after_the_run(tmp_path):
    browser = chromium()
    port = free_port()
    # a run far longer than the test: stopped cleanly (SIGTERM to the launcher) once the page has been read
    settings = {**PACED, "generator.duration": 600.0, "metrics.endpoint": f"127.0.0.1:{port}"}
    cmd = [sys.executable, "-m", "deploy.launch", "-n", "4", "--", "--config", str(write_config(tmp_path, settings))]
    proc = subprocess.Popen(cmd, env=mpi_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while (before := scrape(port)) is None or total(before, "streamjoin_input_tuples_total") < 6000 * 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the cluster did not start serving"
            time.sleep(0.5)
        dom = browse(browser, f"http://127.0.0.1:{port}/", "--dump-dom")
        after = scrape(port)
        browse(browser, f"http://127.0.0.1:{port}/", f"--screenshot={tmp_path / 'dashboard-live.png'}")
        assert proc.poll() is None, "the run ended before the page was read: the check would be of the final page"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    assert proc.returncode == 0, proc.stderr.read()
    assert 'data-ready="1"' in dom, "the charts were not drawn (fewer than two samples)"
    assert shown(dom, "status") == "live"
    slaves = {dict(labels)["slave"] for (name, labels) in after if name == "streamjoin_slave_active"}
    assert int(shown(dom, "slave-count")) == len(slaves) == 3
    on_page = int(shown(dom, "input-total", "data-value"))
    assert total(before, "streamjoin_input_tuples_total") <= on_page <= total(after, "streamjoin_input_tuples_total")
    assert dom.count('class="series"') >= 4 and dom.count('class="bar"') == 3 * 3  # lines drawn; 3 bars a slave
    assert (tmp_path / "dashboard-live.png").stat().st_size > 10_000
    # after the run: the same page from the files, with the summary's totals
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    with dashboard_of(out) as url:
        dom = browse(browser, url, "--dump-dom")
        browse(browser, url, f"--screenshot={tmp_path / 'dashboard-after.png'}")
        final = urllib.request.urlopen(url + "metrics", timeout=5).read().decode()
    assert shown(dom, "status") == "finished"
    assert (
        int(shown(dom, "input-total", "data-value"))
        == summary["input_total"]
        == total(parse(final), "streamjoin_input_tuples_total")
    )
    print(f"screenshots: {tmp_path / 'dashboard-live.png'} {tmp_path / 'dashboard-after.png'}", file=sys.stderr)
