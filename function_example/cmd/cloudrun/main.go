// Command cloudrun is the example as a plain net/http Cloud Run service, for
// teams not on the functions framework. Point push subscriptions (or
// Eventarc triggers) at /orders and /status. `make function-source` writes
// a self-contained source directory (vendored) that holds this command too:
//
//	make function-source
//	gcloud run deploy orders --source=build/function --set-build-env-vars=GOOGLE_BUILDABLE=./cmd/cloudrun --set-env-vars=GOOGLE_CLOUD_PROJECT=my-project
//	gcloud pubsub subscriptions create orders-push --topic orders \
//	    --push-endpoint "$URL/orders" --push-auth-service-account SA \
//	    --dead-letter-topic orders-dead --max-delivery-attempts 10
//
// The service listens on $PORT (default 8080).
package main

import (
	"context"
	"log"
	"log/slog"
	"net/http"
	"os"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
)

func main() {
	slog.SetDefault(slog.New(idempotency.NewLogHandler(os.Stderr, nil)))
	backend, lease, err := orders.Setup(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/orders", idempotency.PushHandler(backend, orders.HandleOrder, orders.OrderOptions(lease)...))
	mux.Handle("/status", idempotency.PushHandler(backend, orders.HandleStatusUpdate(backend, lease), orders.StatusOptions(lease)...))
	port := os.Getenv("PORT")
	if port == "" {
		port = "8080"
	}
	slog.Info("listening", "port", port)
	log.Fatal(http.ListenAndServe(":"+port, mux))
}
