"""Gap detection, repair, resend and sweep: Tidemark notices and mends holes in its own history.

`detect` walks a stream's manifest, files and slot and decides ``repair`` (the slot still covers every
missing range: `repair` re-drains exactly those ranges under their original sequence numbers) or
``resend`` (`resend` forgets what cannot be replayed and re-snapshots at a new consistent point);
`sweep` registers or quarantines files written but never registered. Nothing is ever deleted: bad or
foreign files are moved to ``{stream}/quarantine/``. What counts as a gap: docs/internals/capture.md.

Modules: ``detection`` (`detect`, `decide`), ``repairs`` (`repair`), ``resends`` (`resend`,
`forget_lost`), ``sweeps`` (`sweep`), and ``common`` (report types, landing keys, file checks).
Imports `tidemark.capture` (to re-drain and re-snapshot), `tidemark.landing`, `tidemark.control`,
`tidemark.lsn` and `tidemark.errors`; never the consolidation or the lake.
"""

from tidemark.gaps.common import (GAP_KINDS, LOCK_PURPOSE, RESEND_LOCK_PURPOSE, SWEEP_LOCK_PURPOSE, VERIFY_LEVELS,
                                  Gap, GapReport, RepairResult, ResendResult, SweepResult, inspect_file, move_aside,
                                  quarantine_key, segment_key)
from tidemark.landing.store import landing_store     # the one factory of a stream's landing store
from tidemark.gaps.detection import _Tiler, decide, detect
from tidemark.gaps.repairs import repair
from tidemark.gaps.resends import forget_lost, resend
from tidemark.gaps.sweeps import sweep

__all__ = ["GAP_KINDS", "Gap", "GapReport", "RepairResult", "ResendResult", "SweepResult", "decide", "detect",
           "forget_lost", "inspect_file", "landing_store", "move_aside", "quarantine_key", "repair", "resend",
           "segment_key", "sweep", "LOCK_PURPOSE", "RESEND_LOCK_PURPOSE", "SWEEP_LOCK_PURPOSE", "VERIFY_LEVELS",
           "_Tiler"]
