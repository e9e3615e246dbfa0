#!/usr/bin/env bash
# Builds, in a scratch directory, what a user's module looks like when it
# imports the root package and one backend (replaced by this checkout, as
# a published version would be required), and checks its module graph
# (`go list -m all`): a backend brings its own driver and nothing of the
# other backends. Prints the number of modules in each graph.
#
# The rule, per consumer (the modules each must not have):
#   root only      no backend driver, no grpc, no genproto, and of
#                  OpenTelemetry the API only (no SDK, no exporter)
#   redislock      no Datastore/Google API/grpc/genproto, no pgx, MySQL, SQLite,
#                  no bsm/redislock (its benchmarks only: internal/benchtest)
#   sqllock        no go-redis, no Datastore/grpc/genproto, and no SQL driver
#                  at all: the user picks one
#   pgxlock        no go-redis, MySQL, SQLite or lib/pq (pgx only), no
#                  Datastore/grpc/genproto
#   datastorelock  no go-redis, pgx, MySQL or SQLite
#   pushauth       no backend driver, no Datastore: Google's API client only
#   pull           no backend driver, no Datastore: the Pub/Sub client only
#                  (its tests on real stores are a module of their own:
#                  pull/internal/realtest)
# The root module requires the functions framework for its own tests, so
# the framework's module is in every graph; the grpc and genproto modules
# it would bring are not (module graph pruning).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
M=github.com/gcp-pubsub-idempotency/idempotency
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export GOWORK=off GOFLAGS=-mod=mod

drivers='github.com/redis/go-redis|github.com/jackc/pgx|github.com/go-sql-driver/mysql|modernc.org/sqlite|github.com/mattn/go-sqlite3|github.com/lib/pq'
google='cloud.google.com/go/datastore|google.golang.org/grpc|google.golang.org/genproto|google.golang.org/api'
otelsdk='go.opentelemetry.io/otel/sdk|go.opentelemetry.io/otel/exporters|github.com/GoogleCloudPlatform/opentelemetry-operations-go'

rc=0
check() { # name, forbidden-regexp, packages...
	local name=$1 forbid=$2
	shift 2
	local dir=$scratch/$name
	mkdir -p "$dir"
	{
		printf 'module example.com/consumer\n\ngo 1.26\n\nrequire %s v0.0.0-00010101000000-000000000000\n' "$M"
		printf 'replace %s => %s\n' "$M" "$root"
		for b in datastorelock firestorelock pgxlock redislock spannerlock sqllock; do
			printf 'replace %s/store/%s => %s/store/%s\n' "$M" "$b" "$root" "$b"
		done
		printf 'replace %s/pushauth => %s/pushauth\n' "$M" "$root"
		printf 'replace %s/pull => %s/pull\n' "$M" "$root"
	} >"$dir/go.mod"
	{
		printf 'package main\n\nimport (\n'
		for p in "$@"; do printf '\t_ "%s"\n' "$p"; done
		printf ')\n\nfunc main() {}\n'
	} >"$dir/main.go"
	if ! (cd "$dir" && go mod tidy && go build ./...) >"$dir/log" 2>&1; then
		cat "$dir/log"
		echo "consumer-graph.sh: the $name consumer does not build" >&2
		exit 1
	fi
	local all bad
	all=$(cd "$dir" && go list -m all)
	bad=$(echo "$all" | grep -E "^($forbid)( |$|/)" || true)
	printf '%-34s %4d modules' "root + ${name#root-}" "$(echo "$all" | wc -l)"
	if [ -n "$bad" ]; then
		printf '  FAIL, it has:\n%s\n' "$(echo "$bad" | sed 's/^/    /')"
		rc=1
	else
		printf '  ok\n'
	fi
}

check root-only "$drivers|$google|$otelsdk" "$M" "$M/fake"
check redislock "$google|github.com/jackc/pgx|github.com/go-sql-driver/mysql|modernc.org/sqlite|github.com/bsm/redislock" "$M" "$M/store/redislock"
check sqllock "$google|$drivers" "$M" "$M/store/sqllock"
check pgxlock "$google|github.com/redis/go-redis|github.com/go-sql-driver/mysql|modernc.org/sqlite|github.com/mattn/go-sqlite3|github.com/lib/pq" "$M" "$M/store/pgxlock"
check datastorelock "$drivers" "$M" "$M/store/datastorelock"
check pushauth "$drivers|cloud.google.com/go/datastore" "$M" "$M/pushauth"
check pull "$drivers|cloud.google.com/go/datastore" "$M" "$M/pull"
check firestorelock "$drivers|cloud.google.com/go/datastore" "$M" "$M/store/firestorelock"
check spannerlock "$drivers" "$M" "$M/store/spannerlock"
exit $rc
