"""``python -m tidemark.cli``: the ``tidemark`` command (`tidemark.cli.main`)."""
from tidemark.cli import main

raise SystemExit(main())
