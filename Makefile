# The README's two set-up commands are `make demo` and `make test`.
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
# Every package of every module of the workspace (go.work): the root module
# and each module under it (store/<backend>, function_example, e2e).
MOD := github.com/gcp-pubsub-idempotency/idempotency
ALL := $(MOD)/...

.PHONY: test check services demo e2e function-source bench bench-all storm consumer-graph apidiff

# Everything CI runs: formatting, vet, staticcheck, and every test under the
# race detector, with every backend against its real server: a missing
# server fails the run instead of skipping it. A package may take 60
# minutes: the emulator-backed ones (Firestore above all) run for tens of
# minutes on a loaded 2-core machine. Last, a smoke run of make bench's
# comparisons, so that they work on a fresh machine too.
test: check services
	IDEMPOTENCY_REQUIRE_SERVICES=1 go test -race -count=1 -timeout 60m $(ALL)
	./scripts/consumer-graph.sh
	APIDIFF_WARN=1 ./scripts/apidiff.sh
	FUZZTIME=20000x ./scripts/fuzz.sh
	@echo "make bench, one round of one iteration at 1 worker (its figures mean nothing; it proves the script runs):"
	ROUNDS=1 BENCHTIME=1x WORKERS=1 ./scripts/benchstat.sh >/dev/null

# Install the servers the backend tests start (redis-server, ...).
services:
	./scripts/install-services.sh

check:
	@out="$$(find . -name '*.go' -not -path './build/*' -not -path '*/vendor/*' -print0 | xargs -0 gofmt -l)"; if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	./scripts/tidy.sh
	go vet $(ALL)
	go run $(STATICCHECK) $(ALL)

# The example function on the in-memory store: one order delivered three
# times, sent to the supplier once. The in-memory store whatever the
# environment says (an exported GOOGLE_CLOUD_PROJECT, REDIS_ADDR, ...): a
# real one only by cmd/local's -backend flag.
demo:
	go run ./function_example/cmd/local -backend=memory

# The end-to-end scenarios and the crash storm alone (also part of make test).
e2e: services
	IDEMPOTENCY_REQUIRE_SERVICES=1 go test -count=1 -v $(MOD)/e2e

# The crash storms at scale, on Datastore, Redis and PostgreSQL in turn:
# the push storm with at least 1000 orders on 8 instances each, then the
# pull storm (subscriber processes; on pgxlock too; and HandlerTx on
# PostgreSQL through sqllock and through pgxlock) with 200
# orders on 8 processes, with the figures (orders, instances or processes,
# deliveries, crashes, kills, re-sends, lost, duplicates) for each backend.
# STORM_ORDERS, STORM_PULL_ORDERS, STORM_INSTANCES, STORM_CRASH_RATE,
# STORM_KILL_EVERY, STORM_PULL_KILL_EVERY, STORM_LEASE and STORM_BACKEND
# override the defaults.
STORM_ORDERS ?= 1000
STORM_PULL_ORDERS ?= 200
STORM_INSTANCES ?= 8
storm: services
	STORM_ORDERS=$(STORM_ORDERS) STORM_PULL_ORDERS=$(STORM_PULL_ORDERS) STORM_INSTANCES=$(STORM_INSTANCES) IDEMPOTENCY_REQUIRE_SERVICES=1 \
		go test -count=1 -v -timeout 3h -run '^(TestCrashStorm|TestPullCrashStorm|TestPullCrashStormOnPgxlock|TestPullCrashStormTransactionalOnPostgres|TestPullCrashStormTransactionalOnPgxlock)$$' $(MOD)/e2e

# The directory to deploy the example function from (see the README).
function-source:
	./scripts/function-source.sh build/function

# Every fuzz target of every package, one million executions each (set
# FUZZTIME=30s or FUZZTIME=5000000x to change it); `make test` runs each
# for 20000 executions (a count, not a duration: see scripts/fuzz.sh).
.PHONY: fuzz
fuzz:
	./scripts/fuzz.sh

# One table: each backend's Lock beside its baselines (plain writes, naive
# transactions, ...) at 1 and 16 workers, with the ratio, from one run
# (docs/performance.md). A backend whose server is missing gets a note row.
# BENCHTIME and BENCHCOUNT override -benchtime and -count. Then
# scripts/benchstat.sh prints benchstat's comparisons (with confidence
# intervals) of Redis, PostgreSQL and the wrapper through the functions
# framework, from rounds that alternate (`make bench-stat` alone; ROUNDS
# and STATTIME override its 6 rounds of -benchtime 2000x).
# The table stays beside benchstat: the wrapper's, Datastore's, Firestore's and Spanner's benchmarks name their sides as bare sub-benchmark elements (lock, naive-2-transactions), which benchstat cannot put in columns (it keys on key=value elements only), and the table gives a missing server a row.
BENCHTIME ?= 500ms
BENCHCOUNT ?= 3
ROUNDS ?= 6
STATTIME ?= 2000x
bench:
	go run ./internal/benchtable -benchtime $(BENCHTIME) -count $(BENCHCOUNT)
	ROUNDS=$(ROUNDS) BENCHTIME=$(STATTIME) ./scripts/benchstat.sh

.PHONY: bench-stat
bench-stat:
	ROUNDS=$(ROUNDS) BENCHTIME=$(STATTIME) ./scripts/benchstat.sh

# Every benchmark of every module, three times, as go test prints them.
bench-all:
	go test -run '^$$' -bench . -benchtime 2s -count 3 $(ALL)

# The exported API of every module against BASE (default: the latest
# release tag; with none, it says so and passes): fails on a change that
# would break a user's code. make test runs it as a warning only, since a
# v0 minor release may break; go run ./internal/release enforces it
# against the version being released (docs/develop.md, Releasing).
BASE ?=
apidiff:
	./scripts/apidiff.sh $(BASE)

# What a user's module graph holds when it imports the root package and one
# backend: fails if a backend brings another backend's driver.
consumer-graph:
	./scripts/consumer-graph.sh
