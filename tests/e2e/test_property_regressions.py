"""Plans of the property-based oracle (test_property_oracle.py) kept as ordinary tests: each is a plan
(see property_kit) run against a fresh source database, with the lake compared to the source after
every consolidation and parity checked against that comparison. Add every example the property test
shrinks to here."""

from __future__ import annotations

import pytest

import property_kit as K
from test_property_oracle import run_plan

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROW = {"ts": "2000-01-01 00:00:00", "tstz": "2000-01-01 00:00:00+00", "n": "0", "nn": "NaN", "f8": -0.0,
       "f4": float("nan"), "bo": True, "c": "ab", "iv": "1 day", "e": "ok", "dm": 7, "arr": [1, None, 3],
       "tarr": ["a", None], "j": "[]", "js": '"x"', "by": b"\x00", "big": "big1-" + "abcdefghij" * 300,
       "bigb": bytes([1]) * 4000}

# The plans below were found by hypothesis with test_property_oracle.py (CI profile, derandomized) on
# the code before the fixes of issue 8. Hypothesis stopped shrinking after five minutes, leaving plans
# of 15 and 17 transactions that took 4-12 minutes each; they were then reduced by delta debugging:
# candidate plans were run with run_plan on the unfixed code, and a candidate was kept when it still
# failed with the same error (ddmin over cycles, transactions, then operations; then TOASTed values,
# timestamps and chains simplified one at a time). Each reduced plan fails as described on the unfixed
# code and passes on the fixed one.

# found by hypothesis on the pre-fix code (commit baa307d's type conversions reverted in
# consolidate/job.py _resolve_moved/_resolution and transform.py fill_moved), where it failed with
#   ConsolidateFailed: ... table public.comp ... while consolidating: ArrowTypeError: All types must be
#   compatible, expected: timestamp[us, tz=UTC], but got: timestamp[us]
#   (_resolution <- _resolve_moved <- apply_changes <- consolidate_table)
# reduced by delta debugging (30 checks) from 15 transactions of 84 operations over 3 cycles to 2
# transactions of one operation each and 1 cycle: a row inserted in the batch with a TOASTed `big`,
# then its composite key changed twice in one transaction ((2,y) -> (28,y) -> (21,x)), `big` untouched;
# the second link's old key is the first link's new key, so its values are resolved in a second round,
# which fed back the `timestamp` column read from Arrow as a local-time timestamp
HYPOTHESIS_ARROW_TYPE = (
    [],
    [([("txn", [("cins", 2, "y", 0, "2000-01-01 00:00:00", K.big(9))], "commit"),
       ("txn", [("ckeychain", [(2, "y"), (28, "y"), (21, "x")])], "commit")], None)],
    [])

# found on the same pre-fix run while shrinking the one above ("1 more distinct error"); it failed with
#   ConsolidateFailed: ... table public.comp ... while consolidating: ValueError: operands could not be
#   broadcast together with shapes (10,) (8,)
#   (_resolution `from_lake = (lake_idx >= 0) & ...` <- _resolve_moved): more lake matches than moved rows.
# It failed the same way on the fixed code too (a second bug: two moved rows with the same old key made
# _lookup return that key's lake row twice); fixed in _lookup, one lake row per old key (commit b4a3385).
# Reduced from 17 transactions of 65 operations (1 cycle) to 4 transactions of one operation each and
# 1 cycle: the first candidate checked was built by hand from the plan's moves of key (2,x), then
# delta debugging found no smaller variant that still fails: the lake's row (2,x) moves to (2,y), a new
# row is inserted at (2,x) and moves to (3,x), both moves in one batch with `big` untouched, so two
# moved rows share the old key (2,x)
HYPOTHESIS_BROADCAST = (
    [("txn", [("cins", 2, "x", 0, "2000-01-01 00:00:00", K.big(2))], "commit")],
    [([("txn", [("ckey", 2, "x", 2, "y")], "commit"),
       ("txn", [("cins", 2, "x", 0, "2000-01-01 00:00:00", K.big(3))], "commit"),
       ("txn", [("ckey", 2, "x", 3, "x")], "commit")], None)],
    [])

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
    "hypothesis_comp_key_chains_arrow_type": HYPOTHESIS_ARROW_TYPE,
    "hypothesis_comp_key_chains_broadcast": HYPOTHESIS_BROADCAST,
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_found_example(pg_cluster, control_dsn, spark, name):
    run_plan(pg_cluster, control_dsn, spark, PLANS[name])
