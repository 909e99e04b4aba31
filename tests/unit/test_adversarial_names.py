"""Regressions found by the adversarial e2e tests: names that need quoting, paths that need
percent-encoding."""

from __future__ import annotations

import pytest

from tidemark.config import TableRef
from tidemark.lake import table_uri
from tidemark.pgtypes import TableSchema, lake_name_problem, qualified_name
from tidemark.landing.store import LocalStore, file_uri_path, open_store, read_uri


@pytest.mark.parametrize("schema,name", [("public", "items"), ("Sales Data", "Order.Items"), ("a.b", "c"),
                                         ("a", "b.c"), ('we"ird', "x"), ("s", "Ünï")])
def test_qualified_names_are_unambiguous_and_parse_back(schema, name):
    text = qualified_name(schema, name)
    assert TableRef.parse(text) == TableRef(schema, name)
    assert TableRef(schema, name).qualified == text
    assert TableSchema(schema=schema, name=name, oid=1, columns=()).qualified == text


def test_dotted_names_do_not_collide():
    assert qualified_name("a.b", "c") != qualified_name("a", "b.c")
    assert qualified_name("public", "items") == "public.items"


def test_lake_dirs_of_dotted_names_differ():
    from tidemark.config import parse_config

    cfg = parse_config({"stream": "s", "source": {"connection": "c", "tables": ["x.y"]},
                        "landing": {"url": "/tmp/l"}, "lake": {"path": "/tmp/k"}})
    assert table_uri(cfg, TableRef("a.b", "c")) != table_uri(cfg, TableRef("a", "b.c"))
    assert table_uri(cfg, TableRef("a.b", "c")) == table_uri(cfg, TableRef("a.b", "c").qualified)


def test_file_uris_with_spaces_and_percent_signs_round_trip(tmp_path):
    root = tmp_path / "my landing %20"
    store = open_store(root.as_uri())
    assert isinstance(store, LocalStore) and store.root == root.resolve()
    uri = store.put('s/snapshots/"Sales Data"."Order.Items"/chunk.parquet', b"abc")
    assert "%20" in uri
    assert read_uri(uri) == b"abc"
    assert file_uri_path(uri).startswith(str(root))


@pytest.mark.parametrize("names,bad", [(["id", "_bucket"], "_bucket"), (["_TM_x"], "_TM_x"), (["_commit_date"], None),
                                       (["A", "a"], "differ only in case")])
def test_lake_name_problem_names_the_column(names, bad):
    problem = lake_name_problem(names)
    assert problem is not None and (bad or names[0]) in problem


def test_ordinary_names_have_no_problem():
    assert lake_name_problem(["id", "time", "diff", "data", "bucket", "tm_x", "Ünï", "Order Id"]) is None


def test_percent_sign_in_a_local_lake_path_is_refused():
    from tidemark.config import parse_config
    from tidemark.errors import ConfigError

    with pytest.raises(ConfigError, match="lake.path.*'%'"):
        parse_config({"stream": "s", "source": {"connection": "c", "tables": ["x.y"]},
                      "landing": {"url": "/tmp/l"}, "lake": {"path": "/tmp/my lake %41"}})


def _unquoted(part: str) -> str | None:
    """How a user may type ``part`` without quotes (PostgreSQL folds unquoted ASCII letters to lower
    case), or None when it needs quotes (a dot, a quote, a space, ASCII upper case)."""
    if any(c in part for c in '." ') or any(c.isascii() and c.isupper() for c in part) or not part:
        return None
    return part


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PART = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\x00"), min_size=1,
                max_size=12)


@settings(max_examples=300, deadline=None)
@given(_PART, _PART)
def test_every_spelling_of_a_table_reaches_the_same_lake_table(schema, name):
    """One normalisation for every entry point (stream file, CLI, Python, DAG params): the quoted form,
    the unquoted form where one exists (``fam2.café``), and the TableRef name the same lake table."""
    from tidemark.config import parse_config

    cfg = parse_config({"stream": "s", "source": {"connection": "c", "tables": ["public.x"]},
                        "control": {"connection": "c"}, "landing": {"url": "/tmp/l"}, "lake": {"path": "/tmp/k"}})
    ref = TableRef(schema, name)
    spellings = [ref, ref.qualified]
    if (us := _unquoted(schema)) is not None and (un := _unquoted(name)) is not None:
        spellings.append(f"{us}.{un}")
        if us == "public":
            spellings.append(un)
    assert len({table_uri(cfg, s) for s in spellings}) == 1, spellings


@pytest.mark.spark
def test_columns_named_star_dot_or_backtick_pass_through_the_arrow_udfs(spark):
    """Found by the generated-schemas test: a column named ``*`` reached ``applyInArrow`` as
    ``df["*"]`` (every column) and the snapshot load failed (INVALID_USAGE_OF_STAR_OR_REGEX)."""
    from tidemark.consolidate import transform as T

    ddl = "`*` long, `a.b` string, `c``d` string, `x*` string, ok string"
    df = spark.createDataFrame([(1, "x", "y", "z", "w"), (2, "p", "q", "r", "s")], ddl)
    safe, names = T.plain_names(df.withColumn("_bucket", T.bucket_expr(["*", "a.b"], 2)))
    out = safe.groupBy("_bucket").applyInArrow(
        lambda t: next(T.named([t], names)).drop_columns(["_bucket"]), ddl).toArrow()
    assert out.column_names == ["*", "a.b", "c`d", "x*", "ok"]
    assert sorted(out.to_pylist(), key=lambda r: r["*"]) == [
        {"*": 1, "a.b": "x", "c`d": "y", "x*": "z", "ok": "w"}, {"*": 2, "a.b": "p", "c`d": "q", "x*": "r", "ok": "s"}]
