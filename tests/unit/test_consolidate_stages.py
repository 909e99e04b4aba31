"""A consolidation batch is a line of typed stages (`tidemark.consolidate.job`'s doc): each stage's
result is frozen, later steps add what they learn to their own result, and the failure context reads
the stages' results (the table a stage was at comes with its exception: `failure.for_table`)."""

import dataclasses

import pytest

from tidemark.config import parse_config
from tidemark.consolidate import batch, committed, decoded, plan, prepare
from tidemark.consolidate.failure import Where, for_table
from tidemark.control import Segment

RESULTS = [plan.BatchPlan, decoded.Decoded, decoded.Scope, prepare.Prepared, prepare.TablePrep,
           batch.MergeOutcome, committed.CommitResult]


@pytest.mark.parametrize("cls", RESULTS, ids=lambda c: c.__name__)
def test_each_stage_result_is_a_frozen_dataclass(cls):
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


def test_a_prepared_table_is_not_changed_by_the_merge_stage():
    p = prepare.Prepared("public.t", "file:///lake/t", None, None, None, [], 0, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.log_plan = object()       # the merge stage takes a copy (`batch._planned`)
    assert dataclasses.replace(p, log_plan="x").log_plan == "x" and p.log_plan is None


def _cfg(tmp_path):
    return parse_config({"stream": "s", "source": {"connection": "src", "slot": "s_slot", "publication": "s_pub",
                                                   "tables": ["public.t", "public.u"]},
                         "landing": {"url": str(tmp_path / "landing")}, "lake": {"path": str(tmp_path / "lake")}})


def test_the_failure_context_reads_the_stages_results(tmp_path, monkeypatch):
    import tidemark.consolidate.failure as failure

    monkeypatch.setattr(failure.Where, "_record", lambda self, detail: None)     # no control database here
    where = Where(_cfg(tmp_path))
    seg = Segment("s", 7, 100, 200, "file:///landing/seg-7", 1, 1, 100, "x")
    where.plan = plan.BatchPlan(100, 100, plan.Coverage(100, 200, [seg]))
    where.scope = decoded.Scope(150, ("public.t", "public.u"), ())
    where.step = "consolidating the batch's tables in one Spark job"
    with pytest.raises(ValueError) as got:
        with for_table("public.u"):
            raise ValueError("injected")
    failed = where.failed(got.value)
    d = failed.detail
    assert d["table"] == "public.u" and d["segment"] == {"seq": 7, "uri": "file:///landing/seg-7"}
    assert d["lower"] is not None and d["frontier"] is not None
    assert d["tables_not_reached"] == ["public.t", "public.u"]
    assert "table public.u" in str(failed) and "segment 7" in str(failed)


def test_the_innermost_stage_names_the_table():
    with pytest.raises(KeyError) as got:
        with for_table("public.outer"):
            with for_table("public.inner"):
                raise KeyError("x")
    assert got.value.tidemark_table == "public.inner"
