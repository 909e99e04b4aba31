"""Stream files a new user gets wrong: each error names the file, the key and what is wrong with it."""

import pytest

from tidemark.config import parse_config
from tidemark.errors import ConfigError

BASE = {"stream": "demo", "source": {"connection": "src", "tables": ["public.a"]},
        "landing": {"url": "/tmp/landing"}, "lake": {"path": "/tmp/lake"}}


def _with(**kw):
    return {**BASE, **kw}


@pytest.mark.parametrize("doc, key", [
    (_with(source={"connection": "src", "tables": ["public.a", "a.b.c"]}), "source.tables[1]"),
    (_with(source={"connection": "src", "tables": ['"Sales.x']}), "source.tables[0]"),
    (_with(source={"connection": "src", "tables": ["public."]}), "source.tables[0]"),
    (_with(source={"connection": "src", "tables": [{"name": "a..b"}]}), "source.tables[0].name"),
    (_with(history=["x.y.z"]), "history[0]"),
])
def test_a_bad_table_name_names_the_stream_file(doc, key):
    """The table name's own errors (`TableRef.parse`) said the key but not the file it is in."""
    with pytest.raises(ConfigError) as err:
        parse_config(doc, origin="streams/orders.yaml")
    assert err.value.key == key
    assert str(err.value).startswith(f"streams/orders.yaml: {key}: "), str(err.value)


@pytest.mark.parametrize("path", ["lake", "data/lake", "./lake", "file://data/lake", "gs://bucket/lake", 5, ["/x"]])
def test_a_lake_path_that_is_not_absolute_local_or_s3_is_refused(path):
    """A relative lake path was taken: every working directory (the CLI's, an Airflow task's, a Spark
    executor's) then has its own lake; a number was said to be missing ("is required")."""
    with pytest.raises(ConfigError) as err:
        parse_config(_with(lake={"path": path}), origin="s.yaml")
    assert err.value.key == "lake.path"
    assert repr(path) in str(err.value) and "must be an absolute path, file:///path or s3://bucket/prefix" in str(
        err.value)


@pytest.mark.parametrize("path", ["/data/lake", "file:///data/lake", "s3://bucket/lake"])
def test_absolute_file_and_s3_lake_paths_are_taken(path):
    assert parse_config(_with(lake={"path": path})).lake_path == path


def test_a_missing_lake_path_says_what_it_must_be():
    with pytest.raises(ConfigError, match=r"lake.path: is required \(an absolute path"):
        parse_config(_with(lake={"retention": "7 days"}))


@pytest.mark.parametrize("landing, key", [
    ({"url": "s3://bucket/l", "endpoint_url": 9000}, "landing.endpoint_url"),
    ({"url": "s3://bucket/l", "endpoint_url": "minio:9000"}, "landing.endpoint_url"),
    ({"url": "s3://bucket/l", "region": 5}, "landing.region"),
])
def test_landing_endpoint_and_region_of_a_wrong_type_are_named(landing, key):
    """An endpoint or region of the wrong type was taken and failed later, far from the file."""
    with pytest.raises(ConfigError) as err:
        parse_config(_with(landing=landing), origin="s.yaml")
    assert err.value.key == key and str(err.value).startswith(f"s.yaml: {key}: ")


def test_an_empty_endpoint_from_the_environment_is_no_endpoint(monkeypatch):
    monkeypatch.setenv("S3_ENDPOINT", "")
    cfg = parse_config(_with(landing={"url": "s3://bucket/l", "endpoint_url": "${S3_ENDPOINT}", "region": "eu-west-1"}))
    assert not cfg.landing.endpoint_url and cfg.landing.region == "eu-west-1"


def test_a_key_given_twice_in_a_stream_file_is_refused_naming_its_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second ``lake:`` section silently replaced the first."""
    from tidemark.config import load_config

    path = tmp_path / "orders.yaml"
    path.write_text("stream: orders\nsource:\n  connection: src\n  tables: [public.a]\n  slot: s1\n  slot: s2\n"
                    "landing: {url: /tmp/landing}\nlake: {path: /tmp/lake}\nlake: {path: /tmp/other}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: (line 9): key 'lake' is given twice (also on line 8); YAML would keep only "
                              "the last one: keep one of them")
    path.write_text(path.read_text().replace("lake: {path: /tmp/other}\n", ""))
    with pytest.raises(ConfigError, match=r"\(line 6\): key 'slot' is given twice \(also on line 5\)"):
        load_config(path)
    # a merge key's values may be overridden: that is YAML's own way to say it once
    path.write_text("x: &common {url: /tmp/landing}\nstream: orders\nsource: {connection: src, tables: [public.a]}\n"
                    "landing: {<<: *common, url: /tmp/l2}\nlake: {path: /tmp/lake}\n")
    with pytest.raises(ConfigError, match=r"^.*: x: unknown key"):
        load_config(path)

