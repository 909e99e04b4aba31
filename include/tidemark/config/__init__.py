"""Stream configuration: YAML files validated into a `StreamConfig`.

A stream file's keys, with an example, are in the manual (docs/configuration.md) and
``include/streams/demo.yaml``. ``landing.url``, ``landing.endpoint_url`` and ``lake.path`` may use
``${VAR}`` from the environment. Errors name the key that is wrong (``source.tables[1]``) and why.
`tidemark.config.model` is what a configuration is, `tidemark.config.parse` reads and checks stream files,
`tidemark.config.source_checks` checks what needs the source database (the table exists, its replica
identity names its rows: a primary key, USING INDEX of a unique index on NOT NULL columns, or FULL).
"""

from tidemark.config.model import (NO_FILTER, ConsolidateConfig, DrainConfig, LandingConfig,  # noqa: F401
                                   SnapshotConfig, SourceConfig, StreamConfig, TableFilter, TableRef)
from tidemark.config.parse import (ACK_POLICIES, LANDING_CODECS, NAME_RE, load_config, load_stream_dir,  # noqa: F401
                                   parse_config, parse_duration, scan_stream_dir)
from tidemark.config.source_checks import (publication_table, replica_identity_problem,  # noqa: F401
                                           trial_filter, validate_against_source)
