"""Plans of the property-based oracle (test_property_oracle.py) kept as ordinary tests: each is a plan
(see property_kit) run against a fresh source database, with the lake compared to the source after
every consolidation and parity checked against that comparison. Add every example the property test
shrinks to here."""

from __future__ import annotations

import pytest

from test_property_oracle import run_plan

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROW = {"ts": "2000-01-01 00:00:00", "tstz": "2000-01-01 00:00:00+00", "n": "0", "nn": "NaN", "f8": -0.0,
       "f4": float("nan"), "bo": True, "c": "ab", "iv": "1 day", "e": "ok", "dm": 7, "arr": [1, None, 3],
       "tarr": ["a", None], "j": "[]", "js": '"x"', "by": b"\x00", "big": "big1-" + "abcdefghij" * 300,
       "bigb": bytes([1]) * 4000}

PLANS = {
    # issue 8: a key changed twice in one batch, its TOASTed values untouched; the second link's old
    # key was itself moved earlier in the batch, so its values are resolved in a second round, which
    # turned `timestamp` into a local-time timestamp (ArrowTypeError: timestamp[us, tz=UTC] vs
    # timestamp[us], in _resolution <- _resolve_moved <- apply_changes) and the stream stayed stuck;
    # this plan fails that way on the code before the fix
    "key_chain_in_one_batch": (
        [("txn", [("ins", 1, ROW)], "commit")],
        [([("txn", [("key", 1, 2)], "commit"), ("txn", [("key", 2, 3)], "commit")], None)],
        []),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_found_example(pg_cluster, control_dsn, spark, name):
    run_plan(pg_cluster, control_dsn, spark, PLANS[name])
