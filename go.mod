module github.com/gcp-pubsub-idempotency/idempotency

go 1.26

require github.com/google/go-cmp v0.7.0 // indirect
