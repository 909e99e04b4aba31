"""Stream configuration: YAML files validated into a `StreamConfig`.

A stream file's keys, with an example, are in the manual (docs/configuration.md) and
``include/streams/demo.yaml``. ``landing.url``, ``landing.endpoint_url`` and ``lake.path`` may use
``${VAR}`` from the environment. Errors name the key that is wrong (``source.tables[1]``) and why.
`tidemark.config.model` is what a configuration is, `tidemark.config.parse` reads and checks stream files,
`tidemark.config.source_checks` checks what needs the source database (the table exists, its replica
identity names its rows: a primary key, USING INDEX of a unique index on NOT NULL columns, or FULL).
"""

from tidemark.config.model import NO_FILTER, StreamConfig, TableRef  # noqa: F401
from tidemark.config.parse import (LANDING_CODECS, load_config, load_stream_dir, parse_config,  # noqa: F401
                                   scan_stream_dir)
from tidemark.config.source_checks import publication_table, trial_filter, validate_against_source  # noqa: F401
