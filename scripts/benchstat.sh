#!/bin/sh
# Prints benchstat's comparisons (medians with 95% confidence intervals,
# and each difference's p-value) of what Lock costs beside its baselines
# where users feel it (docs/performance.md):
#
#   - Redis: Lock beside bsm/redislock's Obtain + Release (with and
#     without a done marker kept for the ttl) and two plain
#     writes, at 1 and 16 workers: deliveries/s, redis-server's time per
#     delivery (INFO commandstats) and CPU time per delivery;
#   - PostgreSQL: Lock beside INSERT ... ON CONFLICT DO NOTHING + UPDATE,
#     at 1 and 16 workers: deliveries/s, server and client CPU per delivery,
#     through database/sql (sqllock) and through pgx's own pool (pgxlock
#     beside the same two writes on the pool);
#   - the wrapper: a push through the functions framework over loopback TCP
#     to Idempotent on redislock, beside a handler making two plain writes.
#
# Each round runs every benchmark once, side by side, and the rounds
# alternate (ROUNDS of them, 6 by default), so that a machine whose load
# drifts moves every side alike. BENCHTIME sets -benchtime (2000x).
# WORKERS selects the worker counts, as a regular expression ("1|16", the
# default; make test's smoke run takes "1": see docs/performance.md for the
# rare 16-worker delivery through the functions framework that gets no
# answer). ONLY=postgres (or ONLY=redis) runs and prints only that
# store's benchmarks (redis includes the functions framework's); KEEP=dir
# keeps the rounds' raw output there (redis.txt, sql.txt).
# benchstat comes from the module proxy, pinned.
set -eu
BENCHSTAT="go run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da"
MOD=github.com/gcp-pubsub-idempotency/idempotency
ROUNDS=${ROUNDS:-6}
BENCHTIME=${BENCHTIME:-2000x}
WORKERS=${WORKERS:-1|16}
ONLY=${ONLY:-}
case "$ONLY" in
"" | redis | postgres) ;;
*) echo "ONLY=$ONLY: want redis or postgres (or unset, for both)" >&2; exit 2 ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# runs reports whether ONLY selects store $1.
runs() { [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]; }
# bench runs test binary $1's benchmarks matching $2 once, appending
# their output to $3 (a failing benchmark's output would go with $tmp:
# it prints it).
bench() {
	"$1" -test.run '^$' -test.bench "$2" -test.benchtime "$BENCHTIME" >"$tmp/out" ||
		{ cat "$tmp/out" >&2; exit 1; }
	cat "$tmp/out" >>"$3"
}

if runs redis; then go test -c -o "$tmp/redis.test" $MOD/store/redislock/internal/benchtest; fi
if runs postgres; then go test -c -o "$tmp/sql.test" $MOD/store/sqllock/internal/enginetest; fi
i=0
while [ "$i" -lt "$ROUNDS" ]; do
	i=$((i + 1))
	echo "round $i of $ROUNDS" >&2
	if runs redis; then bench "$tmp/redis.test" "(ServerTime|Framework)/impl=/workers=($WORKERS)\$" "$tmp/redis.txt"; fi
	if runs postgres; then bench "$tmp/sql.test" "ServerCPU/impl=/workers=($WORKERS)\$" "$tmp/sql.txt"; fi
done

if runs redis; then
	echo "## Redis: Lock beside bsm/redislock Obtain + Release"
	$BENCHSTAT -filter '.name:ServerTime' -col '/impl@(bsm-obtain-release lock)' "$tmp/redis.txt"
	echo
	echo "## Redis: Lock beside bsm/redislock Obtain + a done marker (SET PX ttl) + Release"
	$BENCHSTAT -filter '.name:ServerTime' -col '/impl@(bsm-obtain-release-done lock)' "$tmp/redis.txt"
	echo
	echo "## Redis: Lock beside two plain writes (SET NX PX, SET XX PX)"
	$BENCHSTAT -filter '.name:ServerTime' -col '/impl@(baseline-2-round-trips lock)' "$tmp/redis.txt"
	echo
	echo "## The wrapper through the functions framework over TCP, on redislock, beside the handler's own two writes"
	$BENCHSTAT -filter '.name:Framework' -col /impl "$tmp/redis.txt"
fi
if runs postgres; then
	echo "## PostgreSQL through database/sql: Lock (sqllock) beside INSERT ... ON CONFLICT DO NOTHING + UPDATE"
	$BENCHSTAT -col '/impl@(baseline-2-writes lock)' "$tmp/sql.txt"
	echo
	echo "## PostgreSQL through pgx: Lock (pgxlock) beside the same two writes on the pgx pool"
	$BENCHSTAT -col '/impl@(pgx-baseline-2-writes pgx-lock)' "$tmp/sql.txt"
fi
# KEEP names a directory to keep the rounds' raw output in.
if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP" && cp "$tmp"/*.txt "$KEEP"; fi
