#!/usr/bin/env bash
# The steps a CI pipeline takes to gate a sandbox platform on sandspec, shared by the recipes
# in docs/ci.md (GitHub Actions and GitLab CI), so that a pipeline and a laptop run the same
# commands:
#
#   ci/sandspec-ci.sh shard I N OUT [sandspec run flags...]   one shard of the catalog
#   ci/sandspec-ci.sh merge OUT SHARD_DIR...                  the shards joined; the gate
#   ci/sandspec-ci.sh diff PREVIOUS CURRENT REPORT.md         a release review's comparison
#
# Environment: SANDSPEC (the binary; `sandspec` on PATH by default), SANDSPEC_LABEL (ties the
# shards of one pipeline together, e.g. its ID), SANDSPEC_BASELINE (a file of expected
# failures, when the platform has known ones).
#
# A shard's own verdict is not the run's: it writes its evidence and JUnit and succeeds unless
# sandspec itself could not run (a usage or harness error). `merge` is the gate: its exit code
# is the whole run's (0 conformant or the baseline's gate passed, 1 not, 2 shards refused).
# `diff` writes the comparison for the reviewer; a regression shows there and in the gate.
set -euo pipefail

sandspec=${SANDSPEC:-sandspec}

usage() {
  sed -n '6,8p' "$0" >&2
  exit 2
}

cmd=${1:-}
[ "$#" -gt 0 ] && shift
case "$cmd" in
  shard)
    [ "$#" -ge 3 ] || usage
    index=$1 count=$2 out=$3
    shift 3
    args=(run --shard "$index/$count" --out "$out" --junit "$out.junit.xml")
    if [ -n "${SANDSPEC_LABEL:-}" ]; then args+=(--label "$SANDSPEC_LABEL"); fi
    if [ -n "${SANDSPEC_BASELINE:-}" ]; then args+=(--expected-failures "$SANDSPEC_BASELINE"); fi
    code=0
    "$sandspec" "${args[@]}" "$@" || code=$?
    case $code in
      0 | 1) exit 0 ;;
      *) exit "$code" ;;
    esac
    ;;
  merge)
    [ "$#" -ge 2 ] || usage
    out=$1
    shift
    exec "$sandspec" evidence merge "$@" --out "$out"
    ;;
  diff)
    [ "$#" -eq 3 ] || usage
    previous=$1 current=$2 report=$3
    if [ ! -d "$previous" ]; then
      printf '# sandspec evidence diff\n\nNo evidence of a previous release to compare with.\n' >"$report"
      exit 0
    fi
    code=0
    "$sandspec" evidence diff "$previous" "$current" --markdown "$report" --json "${report%.md}.json" || code=$?
    case $code in
      0 | 1) exit 0 ;;
      *) exit "$code" ;;
    esac
    ;;
  *)
    usage
    ;;
esac
