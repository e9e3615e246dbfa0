package redislock_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// postTask sends, over HTTP, the request Cloud Tasks sends for attempt
// retry of task in queue, and returns the status and body.
func postTask(t *testing.T, url, queue, task string, retry int, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+"/tasks/invoice", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{
		"Content-Type":                    "application/json",
		"User-Agent":                      "Google-Cloud-Tasks",
		"X-CloudTasks-QueueName":          queue,
		"X-CloudTasks-TaskName":           task,
		"X-CloudTasks-TaskRetryCount":     strconv.Itoa(retry),
		"X-CloudTasks-TaskExecutionCount": strconv.Itoa(retry),
		"X-CloudTasks-TaskETA":            "1764417600.123456",
	} {
		if v != "" {
			req.Header.Set(k, v)
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TaskHandler on Redis, over real HTTP: a body that fails is released
// and its response passed on, its retry runs and is completed in Redis,
// the retry after that is a 204 without running h; two concurrent
// attempts of one task run h once, the other answered 423; a request
// without the task headers is a 400 that claims nothing.
func TestTaskHandlerOnRedis(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := context.Background()
	var runs atomic.Int32
	entered, release := make(chan struct{}, 1), make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		body, _ := io.ReadAll(r.Body)
		switch string(body) {
		case `{"fail":"once"}`:
			if n == 1 {
				http.Error(w, "ledger unavailable", http.StatusInternalServerError)
				return
			}
		case `{"slow":true}`:
			entered <- struct{}{}
			<-release
		}
		w.Header().Set("X-Run", strconv.Itoa(int(n)))
		fmt.Fprintf(w, "done %s", body)
	})
	srv := httptest.NewServer(idempotency.TaskHandler(b, h, idempotency.WithLease(time.Minute), idempotency.WithLogger(slog.New(slog.DiscardHandler))))
	defer srv.Close()
	key := func(queue, task string) string { return idempotency.TaskEventSourcePrefix + queue + "|" + task }

	// Fails, then succeeds, then is a duplicate.
	if code, body := postTask(t, srv.URL, "invoices", "inv-1", 0, `{"fail":"once"}`); code != 500 || body != "ledger unavailable\n" {
		t.Fatalf("failing attempt: %d %q, want h's 500 and body", code, body)
	}
	if r, err := b.Claim(ctx, key("invoices", "inv-1"), time.Second); err != nil || r.Outcome != store.Won {
		t.Fatalf("after the failure the key is %v %v, want released (claimable)", r.Outcome, err)
	} else if err := b.Release(ctx, r.Claim); err != nil {
		t.Fatal(err)
	}
	if code, body := postTask(t, srv.URL, "invoices", "inv-1", 1, `{"fail":"once"}`); code != 200 || body != `done {"fail":"once"}` {
		t.Fatalf("retry: %d %q, want h's 200", code, body)
	}
	if code, _ := postTask(t, srv.URL, "invoices", "inv-1", 2, `{"fail":"once"}`); code != 204 || runs.Load() != 2 {
		t.Fatalf("retry after success: %d, runs %d; want 204 and two runs", code, runs.Load())
	}
	if r, err := b.Claim(ctx, key("invoices", "inv-1"), time.Second); err != nil || r.Outcome != store.AlreadyDone {
		t.Fatalf("the task's key in Redis: %v %v, want done", r.Outcome, err)
	}

	// Two attempts at once.
	var first struct {
		code int
		body string
	}
	var wg sync.WaitGroup
	wg.Go(func() { first.code, first.body = postTask(t, srv.URL, "invoices", "inv-2", 0, `{"slow":true}`) })
	<-entered
	code, _ := postTask(t, srv.URL, "invoices", "inv-2", 1, `{"slow":true}`)
	close(release)
	wg.Wait()
	if code != http.StatusLocked || first.code != 200 || runs.Load() != 3 {
		t.Fatalf("concurrent attempts: %d and %d, runs %d; want 423 and h's 200 from one run", code, first.code, runs.Load())
	}

	// Not from Cloud Tasks.
	if code, body := postTask(t, srv.URL, "", "", 0, `{}`); code != 400 || !strings.Contains(body, "did not come from Cloud Tasks") || runs.Load() != 3 {
		t.Fatalf("request without task headers: %d %q runs %d; want 400, h not run", code, body, runs.Load())
	}
	if n, err := c.Keys(ctx, prefixOf(b)+"*").Result(); err != nil || len(n) != 2 {
		t.Fatalf("records in Redis: %v %v, want the two tasks'", n, err)
	}
}
