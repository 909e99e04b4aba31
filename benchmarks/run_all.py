"""Run every benchmark script in this folder, one after another, and print their figures.

Benchmarks are not tests: each script prints medians of several runs, side by side with the reference
tool, and their ratio. Run one alone with `.venv/bin/python benchmarks/bench_<name>.py --help`.
"""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    if not scripts:
        print("no benchmarks found")
        return 1
    failed = []
    for script in scripts:
        print(f"=== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script), *sys.argv[1:]]).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
