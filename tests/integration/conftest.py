"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from test_gaps_kit import create_items, items_schema, start_stream


@pytest.fixture
def stream(make_stream, source_conn):
    """A registered stream over ``public.items`` with its slot: (cfg, consistent point, table shape)."""
    create_items(source_conn)
    cfg = make_stream(["public.items"])
    start = start_stream(cfg)
    return cfg, start, items_schema(cfg)
