"""Capture: everything that reads the PostgreSQL source.

``source`` sets up the stream on the source (publication, slot, connections); ``snapshot`` copies
the tables under the slot's exported snapshot (``table_copy``, ``chunks``; ``ranges`` for a resend);
``replication`` is the libpq replication client; ``pgoutput`` decodes (and, for tests, encodes) the
protocol; ``drain`` lands whole transactions that ``reader`` reads from the slot as segments; ``watch``
says when the stream's tables changed. Imports `tidemark.landing`, `tidemark.control`, `tidemark.pgtypes`,
`tidemark.config`, `tidemark.lsn` and `tidemark.errors`; never the consolidation or the lake.
"""
