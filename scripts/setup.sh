#!/usr/bin/env bash
# Set up everything Tidemark needs on a fresh machine: a virtualenv with the pinned requirements,
# pyspark repaired after pyspark-client, the tidemark package (editable), and the Debian packages
# the tests use (docker-compose, PostgreSQL, Java, chromium). Builds the Spark class-data-sharing archive. Idempotent: a second run with unchanged requirements returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TIDEMARK_VENV:-.venv}
PYTHON=${PYTHON:-python3}

need_apt=()
command -v docker-compose >/dev/null 2>&1 || need_apt+=(docker-compose)
[ -x /usr/lib/postgresql/15/bin/pg_ctl ] || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || need_apt+=(postgresql postgresql-contrib)
command -v pgbench >/dev/null 2>&1 || need_apt+=(postgresql-contrib)
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || need_apt+=(chromium)  # the status page's browser test
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian packages: ${need_apt[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null) \
      || echo "setup: warning: could not install ${need_apt[*]} (tests that need them will be skipped)" >&2
  else
    echo "setup: warning: missing ${need_apt[*]}; install them with apt-get as root" >&2
  fi
fi

# A new Spark JVM starts ~6 s faster with a class-data-sharing archive of Spark's classes (built once per
# JDK and Spark installation, ~1 minute; `tidemark spark-cds`). Without it everything still works.
spark_cds() {
  "$VENV/bin/tidemark" spark-cds >/dev/null \
    || echo "setup: warning: could not build the Spark class-data-sharing archive (Spark starts slower)" >&2
}

want=$(cat requirements.txt include/pyproject.toml | sha256sum | cut -c1-16)
stamp="$VENV/.tidemark-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import tidemark" 2>/dev/null; then
  spark_cds
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "setup: installing pinned requirements into $VENV (a minute or two)"
"$VENV/bin/pip" install -q --disable-pip-version-check -r requirements.txt
pyspark_pin=$(grep -E '^pyspark==' requirements.txt)
"$VENV/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$pyspark_pin"
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps -e include
"$VENV/bin/python" - "$pyspark_pin" <<'PY'
import sys, pyspark
want = sys.argv[1].split("==")[1]
if pyspark.__version__ != want:
    sys.exit(f"setup: pyspark reports {pyspark.__version__}, expected {want}: pyspark-client overwrote it")
PY
echo "$want" > "$stamp"
spark_cds
echo "setup: done"
