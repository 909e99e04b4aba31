"""Capture: everything that reads the PostgreSQL source.

``source`` sets up the stream on the source (publication, slot, connections); ``snapshot`` copies
the tables under the slot's exported snapshot; ``replication`` is the libpq replication client;
``pgoutput`` decodes (and, for tests, encodes) the pgoutput protocol; ``drain`` reads whole
transactions from the slot and lands them as segments. Imports `tidemark.landing`,
`tidemark.control`, `tidemark.pgtypes`, `tidemark.config`, `tidemark.lsn` and `tidemark.errors`;
never the consolidation or the lake.
"""
