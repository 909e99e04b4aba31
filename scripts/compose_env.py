#!/usr/bin/env python3
"""Write the compose stack's .env: every variable of .env.example with a fresh random value (mode 0600).

Usage: python3 scripts/compose_env.py [--example .env.example] [--out .env]
Refuses to overwrite an existing file (the databases keep the passwords of their first start).
Prints the names it wrote, never the values. Standard library only.
"""

from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def value_for(name: str) -> str:
    if name == "AIRFLOW_FERNET_KEY":
        return base64.urlsafe_b64encode(os.urandom(32)).decode()
    if name == "S3_ACCESS_KEY":
        return "tidemark" + secrets.token_hex(6)
    return secrets.token_urlsafe(32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--example", type=Path, default=ROOT / ".env.example")
    ap.add_argument("--out", type=Path, default=ROOT / ".env")
    args = ap.parse_args(argv)
    names = [line.split("=", 1)[0].strip() for line in args.example.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#") and "=" in line]
    try:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(f"{args.out} exists; not overwriting it (delete it first to start over with new secrets)",
              file=sys.stderr)
        return 1
    with os.fdopen(fd, "w") as fh:
        fh.write("# written by scripts/compose_env.py from .env.example; keep it private\n")
        fh.writelines(f"{name}={value_for(name)}\n" for name in names)
    print(f"wrote {args.out} (mode 0600): {' '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
