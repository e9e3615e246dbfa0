# The README's two set-up commands are `make demo` and `make test`.
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2

.PHONY: test check services demo bench

# Everything CI runs: formatting, vet, staticcheck, and every test under the
# race detector, with every backend against its real server: a missing
# server fails the run instead of skipping it.
test: check services
	IDEMPOTENCY_REQUIRE_SERVICES=1 go test -race -count=1 ./...

# Install the servers the backend tests start (redis-server, ...).
services:
	./scripts/install-services.sh

check:
	@out="$$(gofmt -l .)"; if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	go vet ./...
	go run $(STATICCHECK) ./...

# The example function on the in-memory store: one order delivered three
# times, sent to the supplier once.
demo:
	go run ./function_example/cmd/local

bench:
	go test -run '^$$' -bench . -benchtime 2s -count 3 ./...
