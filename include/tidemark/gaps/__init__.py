"""Gap detection, repair, resend and sweep: Tidemark notices and mends holes in its own history.

`detect` walks a stream's manifest, files and slot and decides ``repair`` (the slot still covers every
missing range: `repair` re-drains exactly those ranges under their original sequence numbers) or
``resend`` (`resend` forgets what cannot be replayed and re-snapshots at a new consistent point);
`sweep` registers or quarantines files written but never registered. Nothing is ever deleted: bad or
foreign files are moved to ``{stream}/quarantine/``. What counts as a gap: docs/internals/capture.md.

Modules: ``detection`` (`detect`, `decide`), ``repairs`` (`repair`), ``resends`` (`resend`,
`forget_lost`), ``sweeps`` (`sweep`), and ``common`` (report types, quarantine, file checks).
Imports `tidemark.capture` (to re-drain and re-snapshot), `tidemark.landing`, `tidemark.control`,
`tidemark.lsn` and `tidemark.errors`; never the consolidation or the lake.
"""

from tidemark.landing.store import landing_store, segment_key  # landing_store: the one factory of a stream's store
from tidemark.gaps.detection import _Tiler, decide, detect
from tidemark.gaps.repairs import repair
from tidemark.gaps.resends import resend
from tidemark.gaps.sweeps import sweep

__all__ = ["decide", "detect", "landing_store", "repair", "resend", "segment_key", "sweep", "_Tiler"]
