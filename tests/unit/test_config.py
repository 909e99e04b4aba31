"""Stream configuration: errors name the key and the reason."""

import pytest

from tidemark.config import TableRef, parse_config, validate_against_source
from tidemark.errors import ConfigError

BASE = {"stream": "demo", "source": {"connection": "src", "tables": ["public.a"]},
        "landing": {"url": "/tmp/landing"}, "lake": {"path": "/tmp/lake"}}


def _with(**kw):
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for k, v in kw.items():
        doc[k] = v
    return doc


def test_defaults():
    cfg = parse_config(_with())
    assert cfg.source.slot == "tidemark_demo" and cfg.source.publication == "tidemark_demo"
    assert cfg.drain.ack_policy == "frontier"
    assert cfg.source.tables == (TableRef("public", "a"),)
    assert cfg.landing.codec == "zstandard"
    assert cfg.consolidate.check_every_minutes == 5
    off = parse_config(_with(consolidate={"check_every_minutes": 0}))
    assert off.consolidate.check_every_minutes == 0 and parse_config(off.as_dict()).consolidate == off.consolidate
    assert cfg.consolidate.follow_seconds == 120
    once = parse_config(_with(consolidate={"follow_seconds": 0}))        # one batch per run
    assert once.consolidate.follow_seconds == 0 and parse_config(once.as_dict()).consolidate == once.consolidate
    with pytest.raises(ConfigError, match="consolidate.follow_seconds"):
        parse_config(_with(consolidate={"follow_seconds": -1}))


def test_landing_codecs_are_the_ones_segments_are_written_with():
    from tidemark.config import LANDING_CODECS
    from tidemark.landing.segments import CODECS

    assert LANDING_CODECS == CODECS
    for codec in CODECS:
        cfg = parse_config(_with(landing={"url": "/tmp/landing", "codec": codec}))
        assert cfg.landing.codec == codec and cfg.as_dict()["landing"]["codec"] == codec
        assert parse_config(cfg.as_dict()).landing == cfg.landing


@pytest.mark.parametrize("doc, key", [
    (_with(stream="Bad-Name"), "stream"),
    (_with(extra=1), "extra"),
    (_with(source={"connection": "src", "tables": []}), "source.tables"),
    (_with(source={"connection": "src", "tables": ["public.a", "a"]}), "source.tables[1]"),
    (_with(source={"connection": "src", "tables": ["a.b.c"]}), "source.tables[0]"),
    (_with(source={"connection": "src", "tables": ["a"], "slot": "x y"}), "source.slot"),
    (_with(landing={"url": "relative/dir"}), "landing.url"),
    (_with(landing={"url": "/tmp/landing", "codec": "lz4"}), "landing.codec"),
    (_with(landing={"url": "/tmp/landing", "codec": None}), "landing.codec"),
    (_with(drain={"ack_policy": "sometimes"}), "drain.ack_policy"),
    (_with(drain={"max_changes": 0}), "drain.max_changes"),
    (_with(drain={"stall_timeout_seconds": 0}), "drain.stall_timeout_seconds"),
    (_with(snapshot={"chunk_pages": "many"}), "snapshot.chunk_pages"),
    (_with(consolidate={"bucket": 3}), "consolidate.bucket"),
    (_with(consolidate={"check_every_minutes": 60}), "consolidate.check_every_minutes"),
    (_with(consolidate={"check_every_minutes": -1}), "consolidate.check_every_minutes"),
    (_with(consolidate={"check_every_minutes": "5m"}), "consolidate.check_every_minutes"),
])
def test_bad_config_names_the_key(doc, key):
    with pytest.raises(ConfigError) as err:
        parse_config(doc)
    assert err.value.key == key
    assert key in str(err.value)


def test_quoted_table_names_keep_case_and_dots():
    assert TableRef.parse('"My Schema"."Odd.Table"') == TableRef("My Schema", "Odd.Table")
    assert TableRef.parse("Public.Orders") == TableRef("public", "orders")


def test_source_checks(source_conn, make_stream):
    with source_conn.cursor() as cur:
        cur.execute("CREATE TABLE keyed (id int PRIMARY KEY); CREATE TABLE nokey (v int); "
                    "CREATE TABLE full_ident (v int); ALTER TABLE full_ident REPLICA IDENTITY FULL")
    validate_against_source(make_stream(["public.keyed", "public.full_ident"]), source_conn)
    with pytest.raises(ConfigError, match=r"source.tables\[1\].*no primary key"):
        validate_against_source(make_stream(["public.keyed", "public.nokey"]), source_conn)
    with pytest.raises(ConfigError, match=r"source.tables\[0\].*does not exist"):
        validate_against_source(make_stream(["public.missing"]), source_conn)


def test_environment_variables_expand_and_unset_ones_are_named(monkeypatch):
    monkeypatch.setenv("TM_ROOT", "/data/tm")
    cfg = parse_config(_with(landing={"url": "${TM_ROOT}/landing"}, lake={"path": "${TM_ROOT}/lake"}))
    assert (cfg.landing.url, cfg.lake_path) == ("/data/tm/landing", "/data/tm/lake")
    monkeypatch.delenv("TM_ROOT")
    with pytest.raises(ConfigError, match="TM_ROOT is not set") as err:
        parse_config(_with(landing={"url": "${TM_ROOT}/landing"}))
    assert err.value.key == "landing.url"


def test_lake_retention_is_a_duration_string_with_a_default_of_7_days():
    assert parse_config(BASE).lake_retention_seconds == 7 * 86400
    for text, seconds in (("1 minute", 60), ("12 hours", 43200), ("2 weeks", 14 * 86400), ("90 seconds", 90),
                          ("1.5 days", 1.5 * 86400)):
        cfg = parse_config({**BASE, "lake": {**BASE["lake"], "retention": text}})
        assert cfg.lake_retention_seconds == seconds, text
        # the control database keeps the configuration as data: it parses back to the same window
        assert parse_config(cfg.as_dict()).lake_retention_seconds == seconds, text
    for bad in ("7", "forever", "0 days", "-1 hour", 7):
        with pytest.raises(ConfigError, match=r"lake.retention.*not a duration such as '7 days'"):
            parse_config({**BASE, "lake": {**BASE["lake"], "retention": bad}})


def test_lake_maintain_is_a_cron_with_a_daily_default():
    assert parse_config(BASE).lake_maintain_cron == "30 3 * * *"
    cfg = parse_config({**BASE, "lake": {**BASE["lake"], "maintain": " */10  * * * 1-5 "}})
    assert cfg.lake_maintain_cron == "*/10 * * * 1-5"
    assert parse_config(cfg.as_dict()).lake_maintain_cron == "*/10 * * * 1-5"
    for bad in ("daily", "* * * *", "61 * * * *", "* * * * * *", 5, ""):
        with pytest.raises(ConfigError, match=r"lake.maintain.*not a cron expression of five fields"):
            parse_config({**BASE, "lake": {**BASE["lake"], "maintain": bad}})
