"""Gap detection, repair, resend and sweep: Tidemark notices and mends holes in its own history.

A stream's segments tile the LSN line from its latest snapshot's consistent point
(``consistent_lsn``): sequence numbers are contiguous and ``upper[n] == lower[n + 1]``. Segments
entirely below the consistent point are *history*. `detect` walks the manifest and finds:

* a missing sequence number (rows ``landed``/``quarantined``/``forgotten`` account for a number;
  ``forgotten`` ones are settled but cover no LSN range);
* an LSN hole or overlap between neighbouring segments;
* a registered, not yet consolidated segment whose file is missing, whose checksum no longer
  matches, that fails `read_segment`, that is not the segment its name says, or whose progress
  counts are not met — such a file is *quarantined* (status ``quarantined``, file kept, incident
  naming segment, record and reason); an open ``counts_unmet`` incident of the consolidation
  counts too;
* a slot that no longer reaches the frontier: missing, ``wal_status = 'lost'``, or confirmed past
  the first missing position.

It decides ``repair`` when the slot still covers every missing range (`repair` re-drains exactly
those ranges with their original sequence numbers), else ``resend`` (`resend` forgets what cannot
be replayed, as Ignite's ``delete_lost_segment_links``, and re-snapshots at a new consistent
point). `sweep` finds files that were written but never registered (K2View's "zombies").

Nothing is ever deleted: bad or foreign files are moved to ``{stream}/quarantine/``.

Modules: ``detection`` (`detect`, `decide`), ``repairs`` (`repair`), ``resends`` (`resend`,
`forget_lost`), ``sweeps`` (`sweep`), and ``common`` (report types, landing keys, file checks).
Imports `tidemark.capture` (to re-drain and re-snapshot), `tidemark.landing`, `tidemark.control`,
`tidemark.lsn` and `tidemark.errors`; never the consolidation or the lake.
"""

from tidemark.gaps.common import (GAP_KINDS, LOCK_PURPOSE, RESEND_LOCK_PURPOSE, SWEEP_LOCK_PURPOSE, VERIFY_LEVELS, Gap, GapReport,
                                  RepairResult, ResendResult, SweepResult, inspect_file, move_aside,
                                  quarantine_key, segment_key)
from tidemark.landing.store import landing_store     # the one factory of a stream's landing store
from tidemark.gaps.detection import _Tiler, decide, detect
from tidemark.gaps.repairs import repair
from tidemark.gaps.resends import forget_lost, resend
from tidemark.gaps.sweeps import sweep

__all__ = ["GAP_KINDS", "Gap", "GapReport", "RepairResult", "ResendResult", "SweepResult", "decide", "detect",
           "forget_lost", "inspect_file", "landing_store", "move_aside", "quarantine_key", "repair", "resend",
           "segment_key", "sweep", "LOCK_PURPOSE", "RESEND_LOCK_PURPOSE", "SWEEP_LOCK_PURPOSE", "VERIFY_LEVELS", "_Tiler"]
