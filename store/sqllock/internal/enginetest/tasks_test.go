package enginetest

import (
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

// TaskHandlerTx on each SQL engine: a Cloud Tasks attempt whose handler
// answers 502 commits nothing and releases the task; the retry's row and
// the task's done mark commit together, and h's 201 reaches the client
// only then; the retry after that is a 204 that writes nothing.
func TestTaskHandlerTxOnEachEngine(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		db, b := e.fresh(t, nil)
		table := fmt.Sprintf("charges_%016x", rand.Uint64())
		if _, err := db.ExecContext(t.Context(), "CREATE TABLE "+table+" (body TEXT)"); err != nil {
			t.Fatal(err)
		}
		insert := "INSERT INTO " + table + " (body) VALUES (?)"
		if e.name == "postgres" {
			insert = "INSERT INTO " + table + " (body) VALUES ($1)"
		}
		var runs atomic.Int32
		th := idempotency.TaskHandlerTx(b, func(w http.ResponseWriter, r *http.Request, tx *sql.Tx) {
			body, _ := io.ReadAll(r.Body)
			if _, err := tx.ExecContext(r.Context(), insert, string(body)); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if runs.Add(1) == 1 {
				http.Error(w, "partner refused", http.StatusBadGateway)
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprint(w, "charged")
		}, idempotency.WithLogger(slog.New(slog.DiscardHandler)))
		rows := func() int {
			var n int
			if err := db.QueryRowContext(t.Context(), "SELECT COUNT(*) FROM "+table).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		deliver := func(retry int) *httptest.ResponseRecorder {
			r := httptest.NewRequest(http.MethodPost, "/tasks/charge", strings.NewReader("charge 10"))
			r.Header.Set("X-CloudTasks-QueueName", "payments")
			r.Header.Set("X-CloudTasks-TaskName", "charge-1")
			r.Header.Set("X-CloudTasks-TaskRetryCount", fmt.Sprint(retry))
			w := httptest.NewRecorder()
			th.ServeHTTP(w, r)
			return w
		}
		if w := deliver(0); w.Code != http.StatusBadGateway || rows() != 0 {
			t.Fatalf("failing attempt: %d %q, rows %d; want h's 502, nothing committed", w.Code, w.Body, rows())
		}
		if w := deliver(1); w.Code != http.StatusCreated || w.Body.String() != "charged" || rows() != 1 {
			t.Fatalf("retry: %d %q, rows %d; want h's 201 and one row", w.Code, w.Body, rows())
		}
		if w := deliver(2); w.Code != http.StatusNoContent || rows() != 1 || runs.Load() != 2 {
			t.Fatalf("retry of the done task: %d, rows %d, runs %d; want 204, no new row, h not run", w.Code, rows(), runs.Load())
		}
	})
}
