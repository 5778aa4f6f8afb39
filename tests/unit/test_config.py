"""Tests of protocol/config.py: defaults, TOML file, --set overrides, validation errors."""

from __future__ import annotations

import pytest

from protocol.config import DEFAULTS, ConfigError, load_config, validate


def write(tmp_path, text, name="run.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults():
    cfg = load_config()
    assert set(cfg) == set(DEFAULTS) | {"streams"} and cfg["streams"] == {}  # [streams.NAME]: protocol.streams
    assert cfg["output"].pop("kafka")["topic"] == ""  # [output.kafka], the result sink: protocol.streams
    for section, keys in DEFAULTS.items():
        assert set(cfg[section]) == set(keys)
        for key, (default, desc) in keys.items():
            assert cfg[section][key] == default and type(cfg[section][key]) is type(default)
            assert desc
    assert cfg["join"]["window"] == 1.0 and cfg["partitioning"]["partitions"] == 60
    assert cfg["source"]["kind"] == "generator" and cfg["output"]["format"] == "parquet"
    # every call gives a fresh dict
    cfg["join"]["window"] = 99.0
    assert load_config()["join"]["window"] == 1.0


def test_file_values_override_defaults(tmp_path):
    p = write(
        tmp_path,
        """
[join]
window = 2.5
max_delay = 0.25

[partitioning]
partitions = 8

[output]
format = "csv"
path = "elsewhere"
""",
    )
    cfg = load_config(p)
    assert cfg["join"]["window"] == 2.5 and cfg["join"]["max_delay"] == 0.25
    assert cfg["partitioning"]["partitions"] == 8
    assert cfg["output"]["format"] == "csv" and cfg["output"]["path"] == "elsewhere"
    assert cfg["partitioning"]["subgroups"] == DEFAULTS["partitioning"]["subgroups"][0]
    cfg2 = load_config(str(p))  # str path works as well
    assert cfg2 == cfg


def test_set_overrides_beat_file(tmp_path):
    p = write(tmp_path, "[join]\nwindow = 2.5\n")
    cfg = load_config(
        p,
        [
            "join.window=0.75",
            "partitioning.partitions=12",
            'output.path="x y"',
            "output.format=csv",
            "generator.seed = 9",
        ],
    )
    assert cfg["join"]["window"] == 0.75 and type(cfg["join"]["window"]) is float
    assert cfg["partitioning"]["partitions"] == 12 and type(cfg["partitioning"]["partitions"]) is int
    assert cfg["output"]["path"] == "x y"
    assert cfg["output"]["format"] == "csv"  # bare word is a string
    assert cfg["generator"]["seed"] == 9


def test_set_later_override_wins():
    cfg = load_config(None, ["join.window=3", "join.window=4"])
    assert cfg["join"]["window"] == 4.0


def test_bare_word_path_and_quoted_string():
    cfg = load_config(None, ["output.path=results/run-1", "source.kind='generator'"])
    assert cfg["output"]["path"] == "results/run-1"
    assert cfg["source"]["kind"] == "generator"


def test_int_for_float_key_is_float(tmp_path):
    cfg = load_config(write(tmp_path, "[join]\nwindow = 3\n[generator]\nrate = 100\n"))
    assert cfg["join"]["window"] == 3.0 and isinstance(cfg["join"]["window"], float)
    assert isinstance(cfg["generator"]["rate"], float)
    cfg = load_config(None, ["epochs.distribution=1"])
    assert type(cfg["epochs"]["distribution"]) is float and cfg["epochs"]["distribution"] == 1.0


def raises_naming(fragment, *args, **kw):
    with pytest.raises(ConfigError) as err:
        load_config(*args, **kw)
    assert fragment in str(err.value), str(err.value)
    return str(err.value)


def test_bool_is_parsed_and_rejected_for_non_bool_keys(tmp_path):
    msg = raises_naming("generator.seed", None, ["generator.seed=true"])
    assert "True" in msg  # parsed as a boolean, not as the string "true"
    raises_naming("join.window", None, ["join.window=false"])
    raises_naming("output.format", write(tmp_path, "[output]\nformat = true\n"))


def test_unknown_section(tmp_path):
    raises_naming("[nope]", write(tmp_path, "[nope]\nx = 1\n"))
    raises_naming("[nope]", None, ["nope.x=1"])
    raises_naming("[window]", write(tmp_path, "window = 1.0\n", "top.toml"))  # key outside any table


def test_unknown_key(tmp_path):
    raises_naming("join.windw", write(tmp_path, "[join]\nwindw = 1.0\n"))
    raises_naming("tuning.theta", None, ["tuning.theta=3"])


@pytest.mark.parametrize(
    "override,key",
    [
        ('generator.rate="1.0"', "generator.rate"),  # a rate is no duration: text is a wrong type
        ("join.window=abc", "join.window"),
        ("partitioning.partitions=2.5", "partitioning.partitions"),
        ("output.path=5", "output.path"),
        ("generator.keys=[1, 2]", "generator.keys"),
        ("generator.rate=inf", "generator.rate"),
        ("join.window=nan", "join.window"),
    ],
)
def test_wrong_type(override, key):
    raises_naming(key, None, [override])


def test_wrong_type_in_file(tmp_path):
    raises_naming("join.max_delay", write(tmp_path, '[join]\nmax_delay = "half a second"\n'))


def test_malformed_override():
    for bad in ("joinwindow=1", "join.window", "window=1"):
        with pytest.raises(ConfigError, match="section.key=value"):
            load_config(None, [bad])


@pytest.mark.parametrize(
    "override,key",
    [
        ("join.window=-1", "join.window"),
        ("join.max_delay=-0.1", "join.max_delay"),
        ("tuning.block_size=0", "tuning.block_size"),
        ("generator.rate=0", "generator.rate"),
        ("generator.skew=1.0", "generator.skew"),
        ("generator.skew=0", "generator.skew"),
        ("generator.skew=-0.2", "generator.skew"),
        ("generator.tuple_bytes=39", "generator.tuple_bytes"),
        ("generator.tuple_bytes=60", "generator.tuple_bytes"),
        ("tuning.max_depth=25", "tuning.max_depth"),
        ("tuning.max_depth=-1", "tuning.max_depth"),
        ("generator.distribution=normal", "generator.distribution"),
        ("generator.zipf=0", "generator.zipf"),
        ("output.format=json", "output.format"),
        ("source.kind=socket", "source.kind"),
        ("source.ts_unit=min", "source.ts_unit"),
        ("source.ts_unit=1000", "source.ts_unit"),
        ("join.window=2e12", "join.window"),  # event time is int64 microseconds: durations below 2**60 us
        ("join.max_delay=1.2e12", "join.max_delay"),
        ("generator.duration=1e13", "generator.duration"),
        ("aggregate.window=4e-7", "aggregate.window"),  # rounds to 0 us: no window at all
    ],
)
def test_value_errors(override, key):
    raises_naming(key, None, [override])


def test_tuning_off_and_other_key_distributions_are_accepted():
    cfg = load_config(None, ["tuning.max_depth=0", "generator.distribution=zipf", "generator.zipf=0.8"])
    assert cfg["tuning"]["max_depth"] == 0 and cfg["generator"]["distribution"] == "zipf"


def test_window_zero_and_skew_inside_are_fine():
    cfg = load_config(None, ["join.window=0", "generator.skew=0.5", "generator.tuple_bytes=40"])
    assert cfg["join"]["window"] == 0.0 and cfg["generator"]["skew"] == 0.5


def test_theta_min_at_most_half_theta_max():
    msg = raises_naming("tuning.theta_min", None, ["tuning.theta_min=10", "tuning.theta_max=19"])
    assert "tuning.theta_max" in msg
    cfg = load_config(None, ["tuning.theta_min=10", "tuning.theta_max=20"])
    assert cfg["tuning"]["theta_min"] == 10


def test_file_source_needs_path(tmp_path):
    raises_naming("source.path", None, ["source.kind=file"])
    cfg = load_config(None, ["source.kind=file", f"source.path={tmp_path / 'in.csv'}"])
    assert cfg["source"]["path"].endswith("in.csv")


def test_partitions_vs_slaves():
    cfg = load_config(None, ["partitioning.partitions=4"])
    validate(cfg, slaves=4)
    validate(cfg, slaves=1)
    with pytest.raises(ConfigError, match="partitioning.partitions"):
        validate(cfg, slaves=5)
    with pytest.raises(ConfigError, match="slave"):
        validate(cfg, slaves=0)


def test_missing_config_file(tmp_path):
    p = tmp_path / "missing.toml"
    msg = raises_naming(str(p), p)
    assert "does not exist" in msg
    raises_naming(str(tmp_path), tmp_path)  # a directory is not a config file


def test_invalid_toml(tmp_path):
    p = write(tmp_path, "[join\nwindow = \n")
    msg = raises_naming(str(p), p)
    assert "TOML" in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_configuration_page_is_made_from_the_defaults():
    """docs/configuration.md is exactly what `python -m protocol.config --reference` prints (regenerate it with
    `make docs`), and it names every key with its default."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent.parent
    made = subprocess.run(
        [sys.executable, "-m", "protocol.config", "--reference"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    page = (root / "docs" / "configuration.md").read_text()
    assert page == made, "docs/configuration.md differs from the defaults in protocol/config.py: run `make docs`"
    for section, keys in DEFAULTS.items():
        for key, (default, _) in keys.items():
            assert f"| `{section}.{key}` | `" in page
    assert '| `join.predicate` | `"equal"` | "equal", "band", "less" |' in page
    assert (
        "| `output.progress` | `1.0` | duration >= 0 |" in page and "| `balance.enabled` | `true` | boolean |" in page
    )


@pytest.mark.parametrize(
    "text,micros",
    [
        ("30s", 30_000_000),
        ("250ms", 250_000),
        ("2m", 120_000_000),
        ("1h", 3_600_000_000),
        ("0.1", 100_000),
        ("1.5us", 2),
        (" 3 min ", 180_000_000),
        ("1e-3s", 1_000),
        ("100ns", 0),
        ("1d", 86_400_000_000),
    ],
)
def test_durations_as_text_are_exact_microseconds(text, micros):
    from protocol.eventtime import duration

    cfg = load_config(None, [f'join.window="{text}"', "epochs.reorganization=2m"])
    assert duration(cfg["join"]["window"]) == micros
    assert cfg["epochs"]["reorganization"] == 120.0


@pytest.mark.parametrize(
    "override,words",
    [
        ("join.window=3 weeks", "got '3 weeks'"),
        ("join.max_delay=-1s", ">= 0"),
        ("output.progress=1,5s", "units"),
        ("join.window=s", "units"),
    ],
)
def test_bad_durations_name_the_key(override, words):
    assert words in raises_naming(override.split("=")[0], None, [override])


def test_durations_in_a_toml_file(tmp_path):
    p = tmp_path / "d.toml"
    p.write_text('[join]\nwindow = "30s"\nmax_delay = "250ms"\n[metrics]\nlog_interval = "1m"\n')
    cfg = load_config(p)
    assert (cfg["join"]["window"], cfg["join"]["max_delay"], cfg["metrics"]["log_interval"]) == (30.0, 0.25, 60.0)


@pytest.mark.parametrize(
    "settings,bounds",
    [
        ([], (-1_000_000, 1_000_000)),  # the default window of 1 s
        (['join.window="250ms"'], (-250_000, 250_000)),  # the shorthand
        (['join.lower="-30s"', 'join.upper="2m"'], (-30_000_000, 120_000_000)),
        (["join.lower=0", "join.upper=0.001"], (0, 1_000)),  # one-sided: s at or after r
        (['join.lower="-2s"', 'join.upper="-500ms"'], (-2_000_000, -500_000)),  # s before r
        (["join.lower=0.1", "join.upper=0.1"], (100_000, 100_000)),  # one offset exactly
    ],
)
def test_time_bounds_from_window_or_lower_and_upper(settings, bounds):
    from protocol.predicates import time_bounds

    cfg = load_config(None, settings)
    assert time_bounds(cfg["join"]) == bounds
    assert (cfg["join"]["lower"] is None) == (not any("lower" in s for s in settings))


@pytest.mark.parametrize(
    "settings,key,words",
    [
        (["join.window=2", "join.lower=0", "join.upper=1"], "join.window", "not together with join.lower"),
        (["join.lower=0"], "join.upper", "required with join.lower"),
        (["join.upper=1"], "join.lower", "required with join.upper"),
        (["join.lower=1", "join.upper=0.5"], "join.lower", "at most join.upper"),
        (['join.lower="-2000000000000s"', "join.upper=0"], "join.lower", "between"),
        (['join.lower="1 week"', "join.upper=0"], "join.lower", "units"),
    ],
)
def test_bad_time_bounds_name_the_keys(settings, key, words):
    assert words in raises_naming(key, None, settings)


def test_window_and_bounds_from_a_file_and_the_command_line_are_refused_together(tmp_path):
    p = write(tmp_path, '[join]\nlower = "-1s"\nupper = "3s"\n')
    assert load_config(p)["join"]["upper"] == 3.0
    raises_naming("join.window", p, ["join.window=1"])


def test_kafka_client_secrets_are_read_from_the_environment_or_a_file_and_never_shown(tmp_path, monkeypatch):
    from protocol.streams import resolved_settings

    secret = tmp_path / "password"
    secret.write_text("s3cret-from-file\n")
    monkeypatch.setenv("SJ_TEST_USER", "app-user")
    got = resolved_settings(
        {"sasl.username": "${env:SJ_TEST_USER}", "sasl.password": f"${{file:{secret}}}", "linger.ms": 5, "x": "$5"},
        "streams.a.kafka.config",
        ConfigError,
    )
    assert got == {"sasl.username": "app-user", "sasl.password": "s3cret-from-file", "linger.ms": 5, "x": "$5"}
    monkeypatch.delenv("SJ_TEST_USER")
    with pytest.raises(
        ConfigError, match=r"streams\.a\.kafka\.config\.sasl\.username: the environment variable SJ_TEST_USER"
    ):
        resolved_settings({"sasl.username": "${env:SJ_TEST_USER}"}, "streams.a.kafka.config", ConfigError)
    with pytest.raises(ConfigError, match=r"sasl\.password: cannot read /nonexistent/pw") as e:
        resolved_settings({"sasl.password": "${file:/nonexistent/pw}"}, "streams.a.kafka.config", ConfigError)
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize(
    "sets, words",
    [
        (["source.speed=2", "source.rate=1000"], "source.rate: not with source.speed"),
        (["source.speed=2", "checkpoint.interval=3"], "checkpoint.interval: not with source.speed yet"),
        (["source.speed=2", 'source.kind="zmq"'], "source.speed: not for live input"),
    ],
)
def test_pacing_by_event_time_is_refused_beside_another_pacing_checkpoints_or_live_input(sets, words):
    with pytest.raises(ConfigError, match=words):
        validate(load_config(None, sets))
    validate(load_config(None, ["source.speed=2"]))  # alone, on stored input
