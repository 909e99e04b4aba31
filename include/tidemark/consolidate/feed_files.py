"""A table's changelog feed in the landing store (`changelog`): ``{stream}/changelog/{table}/`` holds
``{lo:016X}_{F:016X}.avro``, the file of the committed range ``[lo, F)`` (`changelog_key`); under
``_pending/`` the same file before its Delta commit (`pending_key`, published by `publish`) and the
marker of a base no feed file holds yet (`base_marker`); under ``_parts/{run}/`` the CDC parts the
executors of one attempt wrote (`parts_prefix`). `settle` finishes what an interrupted attempt left.
What a file holds, byte for byte, is `cdc_file`'s.
"""

from __future__ import annotations

import contextlib
import os

from tidemark.landing.store import stream_keys


def changelog_key(stream: str, table: str, lower: int, upper: int) -> str:
    return f"{stream_keys(stream)['changelog']}{table}/{lower:016X}_{upper:016X}.avro"


def parts_prefix(stream: str, table: str, run: str) -> str:
    """Where the executors of one consolidation attempt put a table's CDC parts."""
    return f"{feed_prefix(stream, table)}_parts/{run}/"


def feed_prefix(stream: str, table: str) -> str:
    return changelog_key(stream, table, 0, 0).rsplit("/", 1)[0] + "/"


def pending_key(stream: str, table: str, lower: int, upper: int) -> str:
    """A changelog file written before its Delta commit: not a feed file (no ``.avro`` name) until
    `settle` publishes it under `changelog_key` once the commit is there."""
    return f"{feed_prefix(stream, table)}_pending/{lower:016X}_{upper:016X}.avro.pending"


def base_marker(stream: str, table: str, at: int) -> str:
    """The marker of a base at ``at`` that no feed file holds yet (see `commit_changelog`)."""
    return f"{feed_prefix(stream, table)}_pending/{at:016X}.base"


def publish(store, pending: str, key: str) -> None:
    """Make a committed range's file visible under its feed name (then drop the pending copy)."""
    local = getattr(store, "local_path", None)
    if local is not None:
        dst = local(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(local(pending), dst)
        return
    store.put(key, store.get(pending))
    store.delete(pending)


def settle(store, stream: str, table: str, done: int | None, keep_run: str | None = None) -> list[int]:
    """Finish what an interrupted attempt left: a pending file whose range the changelog's Delta log
    has committed is published (the attempt stopped between its commit and the publication); any
    other pending file, and every other attempt's CDC parts, are deleted (never committed). Return
    the times of the bases marked pending (`base_marker`)."""
    prefix = feed_prefix(stream, table)
    waiting = []
    for key in list(store.list(prefix + "_pending/")):
        name = key.rsplit("/", 1)[-1]
        if name.endswith(".base"):
            with contextlib.suppress(ValueError):
                waiting.append(int(name[:-len(".base")], 16))
            continue
        try:
            lo_s, up_s = name.split(".", 1)[0].split("_")
            lo, up = int(lo_s, 16), int(up_s, 16)
        except ValueError:
            continue
        if done is not None and lo < done and up <= done:
            publish(store, key, changelog_key(stream, table, lo, up))
        else:
            store.delete(key)
    keep = parts_prefix(stream, table, keep_run) if keep_run else None
    for key in list(store.list(prefix + "_parts/")):
        if keep is None or not key.startswith(keep):
            store.delete(key)
    return sorted(waiting)


def discard_uncommitted_cdc(store, stream: str, table: str, done: int | None, keep: str) -> None:
    """Delete CDC files of attempts whose Delta commit never happened (their lower is at or past
    the committed frontier), so the files of a table always tile its committed ranges."""
    prefix = feed_prefix(stream, table)
    for key in list(store.list(prefix)):
        name = key[len(prefix):] if key.startswith(prefix) else key.rsplit("/", 1)[-1]
        if "/" in name or not name.endswith(".avro") or key == keep:
            continue
        try:
            lo = int(name.split("_", 1)[0], 16)
        except ValueError:
            continue
        if done is None or lo >= done:
            store.delete(key)

