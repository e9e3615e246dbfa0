module github.com/gcp-pubsub-idempotency/idempotency/store/sqllock

go 1.26.0

require github.com/gcp-pubsub-idempotency/idempotency v0.0.0-00010101000000-000000000000

require (
	github.com/cloudevents/sdk-go/v2 v2.16.2 // indirect
	github.com/json-iterator/go v1.1.12 // indirect
	github.com/modern-go/concurrent v0.0.0-20180306012644-bacd9c7ef1dd // indirect
	github.com/modern-go/reflect2 v1.0.2 // indirect
	go.uber.org/multierr v1.11.0 // indirect
	go.uber.org/zap v1.27.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)

// The root module is not published yet: build against this checkout.
replace github.com/gcp-pubsub-idempotency/idempotency => ../..
