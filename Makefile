# The README's two set-up commands are `make demo` and `make test`.
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2

.PHONY: test check demo bench

# Everything CI runs: formatting, vet, staticcheck, and every test under the
# race detector.
test: check
	go test -race -count=1 ./...

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
