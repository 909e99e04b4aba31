"""`put_if_absent` of two writers racing for one key: the one that writes second never replaces the
first's bytes (it goes through the store's atomic `Store.create`, not a check then a put)."""

from __future__ import annotations

import pytest

from tidemark.errors import TidemarkError
from tidemark.landing.store import LocalStore, put_if_absent


class RacedStore(LocalStore):
    """A store on which another writer lands ``key`` with its own bytes just after this writer
    looked (whichever way it looks: `exists`, or the atomic `create`)."""

    def __init__(self, root, other: LocalStore, theirs: bytes):
        super().__init__(root)
        self.other, self.theirs, self.raced = other, theirs, False

    def _race(self, key: str) -> None:
        if not self.raced:
            self.raced = True
            put_if_absent(self.other, key, self.theirs)

    def exists(self, key: str) -> bool:
        found = super().exists(key)
        self._race(key)           # the other writer writes between this check and what follows it
        return found

    def create(self, key: str, data: bytes) -> bool:
        self._race(key)           # the other writer's create came first
        return super().create(key, data)


def test_the_second_of_two_racing_writers_does_not_overwrite_the_first(tmp_path):
    store = RacedStore(tmp_path, LocalStore(tmp_path), b"first writer's bytes")
    with pytest.raises(TidemarkError, match="already exists with different content"):
        put_if_absent(store, "s/snapshots/manifest.json", b"second writer's bytes")
    assert store.get("s/snapshots/manifest.json") == b"first writer's bytes"


def test_the_second_of_two_racing_writers_with_the_same_bytes_is_told_it_did_not_write(tmp_path):
    store = RacedStore(tmp_path, LocalStore(tmp_path), b"same")
    assert put_if_absent(store, "s/x.avro", b"same") == (store.uri("s/x.avro"), False)
    assert put_if_absent(LocalStore(tmp_path), "s/y.avro", b"new") == (store.uri("s/y.avro"), True)
    assert not [p for p in (tmp_path / "s").iterdir() if p.name.startswith(".tmp-")]
