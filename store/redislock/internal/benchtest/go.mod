module github.com/gcp-pubsub-idempotency/idempotency/store/redislock/internal/benchtest

go 1.26.0

// Development builds use this checkout (consumers ignore replace directives).
replace (
	github.com/gcp-pubsub-idempotency/idempotency => ../../../..
	github.com/gcp-pubsub-idempotency/idempotency/store/redislock => ../..
)

require (
	github.com/GoogleCloudPlatform/functions-framework-go v1.9.2
	github.com/bsm/redislock v0.9.4
	github.com/cloudevents/sdk-go/v2 v2.16.2
	github.com/gcp-pubsub-idempotency/idempotency v0.1.0
	github.com/gcp-pubsub-idempotency/idempotency/store/redislock v0.1.0
	github.com/redis/go-redis/v9 v9.23.0
)

require (
	cloud.google.com/go/functions v1.19.3 // indirect
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/go-logr/logr v1.4.4 // indirect
	github.com/go-logr/stdr v1.2.2 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/json-iterator/go v1.1.12 // indirect
	github.com/modern-go/concurrent v0.0.0-20180306012644-bacd9c7ef1dd // indirect
	github.com/modern-go/reflect2 v1.0.2 // indirect
	go.opentelemetry.io/auto/sdk v1.2.1 // indirect
	go.opentelemetry.io/otel v1.47.0 // indirect
	go.opentelemetry.io/otel/log v1.47.0 // indirect
	go.opentelemetry.io/otel/metric v1.47.0 // indirect
	go.opentelemetry.io/otel/trace v1.47.0 // indirect
	go.uber.org/atomic v1.12.0 // indirect
	go.uber.org/multierr v1.11.0 // indirect
	go.uber.org/zap v1.27.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
)
