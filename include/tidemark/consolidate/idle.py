"""Idle batches: when nothing but progress landed since the frontier, no Spark job runs.

A drain of an idle stream lands a progress-only segment (``{lower, upper, counts: []}``) so the
stream's position still moves. Consolidating such segments changes no lake table: the frontier,
the consolidation subscriber's checkpoint and the slot advance to the end of the run, which the
control database alone records. `progress_only` decides it on the driver without Spark, reading
the (tiny) files of the segments the manifest says hold no records, so the completeness check is
the same as Spark's: a segment that promises a count, or holds a record after all, sends the batch
to the Spark path, which decodes, checks and reports it as before.
"""

from __future__ import annotations

from tidemark.config import StreamConfig

# a progress-only segment is a few hundred bytes; anything larger goes to Spark without being read
MAX_IDLE_BYTES = 64 * 1024


def progress_only(cfg: StreamConfig, segments) -> bool:
    """Whether ``segments`` (a coverage run) hold no record, no event and no promised count."""
    from tidemark.landing.segments import read_segment
    from tidemark.landing.store import read_uri
    from tidemark.errors import TidemarkError

    for seg in segments:
        if seg.record_count or (seg.byte_size or 0) > MAX_IDLE_BYTES:
            return False
    for seg in segments:
        try:
            content = read_segment(read_uri(seg.uri, endpoint_url=cfg.landing.endpoint_url),
                                   seg.uri.rsplit("/", 1)[-1])
        except (OSError, TidemarkError):
            return False        # the Spark path reads it again and names the problem
        if content.updates or content.events or any(c for c in content.counts.values()):
            return False
    return True
