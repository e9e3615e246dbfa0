package idempotency_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

func ExampleTaskHandler() {
	backend := fake.New() // in production: a Datastore, Firestore, Spanner, Redis or SQL backend
	sendInvoice := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		fmt.Printf("sending %s (attempt %s)\n", body, r.Header.Get("X-CloudTasks-TaskRetryCount"))
		fmt.Fprintln(w, "sent")
	})
	mux := http.NewServeMux()
	mux.Handle("POST /tasks/send-invoice", idempotency.TaskHandler(backend, sendInvoice))

	// What Cloud Tasks sends, twice: the first response was lost on the
	// way back, so the task was retried.
	for retry := range 2 {
		r := httptest.NewRequest(http.MethodPost, "/tasks/send-invoice", strings.NewReader("INV-1001"))
		r.Header.Set("X-CloudTasks-QueueName", "invoices")
		r.Header.Set("X-CloudTasks-TaskName", "send-INV-1001")
		r.Header.Set("X-CloudTasks-TaskRetryCount", strconv.Itoa(retry))
		w := httptest.NewRecorder()
		mux.ServeHTTP(w, r)
		fmt.Println("Cloud Tasks sees", w.Code, strings.TrimSpace(w.Body.String()))
	}
	// Output:
	// sending INV-1001 (attempt 0)
	// Cloud Tasks sees 200 sent
	// Cloud Tasks sees 204
}

// A KeyFunc of your own can key a task on its body rather than its name,
// so that two tasks created for one invoice (say, by a producer that
// retried its CreateTask call without a task name) run once.
func ExampleParseTask() {
	byInvoice := func(e cloudevents.Event) (string, error) {
		task, err := idempotency.ParseTask(e)
		if err != nil {
			return "", err
		}
		return task.Queue + ":" + string(e.Data()), nil
	}
	h := idempotency.TaskHandler(fake.New(), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Println("sending the invoice")
	}), idempotency.WithKey(byInvoice), idempotency.WithLogger(slog.New(slog.DiscardHandler)))
	for _, name := range []string{"auto-1", "auto-2"} {
		r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("INV-1001"))
		r.Header.Set("X-CloudTasks-QueueName", "invoices")
		r.Header.Set("X-CloudTasks-TaskName", name)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		fmt.Println(name, w.Code)
	}
	// Output:
	// sending the invoice
	// auto-1 200
	// auto-2 204
}
