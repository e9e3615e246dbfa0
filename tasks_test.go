package idempotency_test

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// taskRequest is a request as Cloud Tasks sends it to an HTTP target:
// the task's headers, attempt retry (0 first), and a JSON body.
func taskRequest(queue, task string, retry int, body string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/tasks/invoice", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("User-Agent", "Google-Cloud-Tasks")
	r.Header.Set("X-CloudTasks-QueueName", queue)
	r.Header.Set("X-CloudTasks-TaskName", task)
	r.Header.Set("X-CloudTasks-TaskRetryCount", strconv.Itoa(retry))
	r.Header.Set("X-CloudTasks-TaskExecutionCount", strconv.Itoa(retry))
	r.Header.Set("X-CloudTasks-TaskETA", "1764417600.123456")
	return r
}

// deliverTask serves r to h and returns what the client sees.
func deliverTask(h http.Handler, r *http.Request) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// taskKey is the default key of task of queue.
func taskKey(queue, task string) string {
	return idempotency.TaskEventSourcePrefix + queue + "|" + task
}

// A task's first attempt runs h and the client gets h's response as h
// wrote it (status, headers, body), once the claim is completed; every
// retry of the task (same headers, a higher retry count) answers 204
// without running h.
func TestTaskHandlerRunsATaskOnceAndAcksItsRetries(t *testing.T) {
	s, _ := newStore(t)
	var runs atomic.Int32
	var seen struct {
		body, method, queue string
		ctxDone             bool
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		seen.body, seen.method, seen.queue = string(b), r.Method, r.Header.Get("X-CloudTasks-QueueName")
		w.Header().Set("X-Invoice", "INV-1")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, "created INV-1")
		// Nothing reaches the client before the claim is completed.
		if rec, ok := s.Record(taskKey("invoices", "inv-1")); !ok || rec.State != store.Claimed {
			t.Errorf("record while h runs: %+v %v, want claimed", rec, ok)
		}
	})
	th := idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard()))
	w := deliverTask(th, taskRequest("invoices", "inv-1", 0, `{"invoice":"INV-1"}`))
	if w.Code != http.StatusCreated || w.Body.String() != "created INV-1" || w.Header().Get("X-Invoice") != "INV-1" {
		t.Fatalf("first attempt: %d %q %v; want h's 201, body and header", w.Code, w.Body, w.Header())
	}
	if seen.body != `{"invoice":"INV-1"}` || seen.method != http.MethodPost || seen.queue != "invoices" {
		t.Fatalf("h saw %+v, want the request as sent", seen)
	}
	if rec, ok := s.Record(taskKey("invoices", "inv-1")); !ok || rec.State != store.Done {
		t.Fatalf("record %+v %v, want done", rec, ok)
	}
	for retry := 1; retry <= 2; retry++ {
		w := deliverTask(th, taskRequest("invoices", "inv-1", retry, `{"invoice":"INV-1"}`))
		if w.Code != http.StatusNoContent || runs.Load() != 1 {
			t.Fatalf("retry %d: %d, runs %d; want 204 and h not run again", retry, w.Code, runs.Load())
		}
	}
}

// A response other than a 2xx is a failure: the claim is released, and
// h's status and body go to Cloud Tasks as h wrote them; the retry runs h
// again and succeeds, and the one after is a duplicate.
func TestTaskHandlerFailureReleasesTheClaimAndPassesTheResponseOn(t *testing.T) {
	for _, status := range []int{http.StatusInternalServerError, http.StatusBadRequest, http.StatusTooManyRequests, http.StatusFound} {
		t.Run(strconv.Itoa(status), func(t *testing.T) {
			s, _ := newStore(t)
			l, logger := newLogs()
			var runs atomic.Int32
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if runs.Add(1) == 1 {
					w.Header().Set("Location", "/elsewhere")
					http.Error(w, "ledger unavailable", status)
					return
				}
				fmt.Fprint(w, "ok")
			})
			th := idempotency.TaskHandler(s, h, idempotency.WithLogger(logger))
			w := deliverTask(th, taskRequest("invoices", "inv-2", 0, `{}`))
			if w.Code != status || w.Body.String() != "ledger unavailable\n" {
				t.Fatalf("failing attempt: %d %q, want h's %d and body", w.Code, w.Body, status)
			}
			assertReleased(t, s, taskKey("invoices", "inv-2"))
			if len(l.find(t, "WARN", "the task handler failed")) != 1 {
				t.Fatalf("logs %v, want one warning", l.records(t))
			}
			if w := deliverTask(th, taskRequest("invoices", "inv-2", 1, `{}`)); w.Code != http.StatusOK || w.Body.String() != "ok" || runs.Load() != 2 {
				t.Fatalf("retry: %d %q runs %d; want h's 200 on its second run", w.Code, w.Body, runs.Load())
			}
			if w := deliverTask(th, taskRequest("invoices", "inv-2", 2, `{}`)); w.Code != http.StatusNoContent || runs.Load() != 2 {
				t.Fatalf("retry after success: %d runs %d; want 204, not run", w.Code, runs.Load())
			}
		})
	}
}

// Two attempts of one task at once (the first ran past the dispatch
// deadline, and Cloud Tasks retried it): one runs h, the other is
// answered 423 without a Retry-After, never a 503 (which would slow the
// whole queue down), and h runs once.
func TestTaskHandlerConcurrentAttemptsOfOneTaskRunItOnce(t *testing.T) {
	s, clock := newStore(t)
	entered, release := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		close(entered)
		<-release
		fmt.Fprint(w, "done")
	})
	th := idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard()), idempotency.WithLease(time.Minute), idempotency.WithNow(clock.Now))
	var first *httptest.ResponseRecorder
	var wg sync.WaitGroup
	wg.Go(func() { first = deliverTask(th, taskRequest("invoices", "inv-3", 0, `{}`)) })
	<-entered
	second := deliverTask(th, taskRequest("invoices", "inv-3", 1, `{}`))
	close(release)
	wg.Wait()
	if second.Code != http.StatusLocked {
		t.Fatalf("second attempt: %d, want 423", second.Code)
	}
	// A Retry-After may slow the whole queue down (see
	// TaskStatusInProgress): the retry config spaces the retries.
	if ra, ok := second.Header()["Retry-After"]; ok {
		t.Fatalf("second attempt: Retry-After %q; want none", ra)
	}
	if first.Code != http.StatusOK || first.Body.String() != "done" || runs.Load() != 1 {
		t.Fatalf("first attempt: %d %q runs %d; want h's 200 from one run", first.Code, first.Body, runs.Load())
	}
}

// Racing goroutines deliver one task many times at once against a real
// contention window: h runs exactly once, every other attempt is a 423
// or a 204, and none is a 503 or a 429.
func TestTaskHandlerRacingAttemptsNeverAnswer503(t *testing.T) {
	s := fake.New()
	var runs atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) })
	th := idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard()))
	codes := make([]int, 16)
	var wg sync.WaitGroup
	for i := range codes {
		wg.Go(func() { codes[i] = deliverTask(th, taskRequest("q", "t", i, `{}`)).Code })
	}
	wg.Wait()
	oks := 0
	for _, c := range codes {
		switch c {
		case http.StatusOK:
			oks++
		case http.StatusNoContent, http.StatusLocked:
		default:
			t.Fatalf("codes %v: %d is neither h's 200, a 204 nor a 423", codes, c)
		}
	}
	if oks != 1 || runs.Load() != 1 {
		t.Fatalf("codes %v, runs %d; want h's 200 once", codes, runs.Load())
	}
}

// A request that did not come from Cloud Tasks (no queue or task header),
// or whose task headers are malformed, is refused with a 400 that says
// what is missing: nothing is claimed and h does not run.
func TestTaskHandlerRefusesRequestsWithoutTaskHeaders(t *testing.T) {
	cases := map[string]struct {
		edit func(http.Header)
		want string
	}{
		"no headers":       {func(h http.Header) { h.Del("X-CloudTasks-QueueName"); h.Del("X-CloudTasks-TaskName") }, "did not come from Cloud Tasks"},
		"no task name":     {func(h http.Header) { h.Del("X-CloudTasks-TaskName") }, "did not come from Cloud Tasks"},
		"empty queue":      {func(h http.Header) { h.Set("X-CloudTasks-QueueName", "") }, "did not come from Cloud Tasks"},
		"repeated name":    {func(h http.Header) { h.Add("X-CloudTasks-TaskName", "other") }, "X-Cloudtasks-Taskname is repeated"},
		"bad retry count":  {func(h http.Header) { h.Set("X-CloudTasks-TaskRetryCount", "-1") }, "X-Cloudtasks-Taskretrycount \"-1\" is not a count"},
		"bad eta":          {func(h http.Header) { h.Set("X-CloudTasks-TaskETA", "tomorrow") }, "X-Cloudtasks-Tasketa \"tomorrow\" is not a time"},
		"not UTF-8":        {func(h http.Header) { h.Set("X-CloudTasks-TaskName", "t\xff") }, "not valid UTF-8"},
		"app engine no id": {func(h http.Header) { h.Del("X-CloudTasks-QueueName"); h.Set("X-AppEngine-QueueName", "q") }, "did not come from Cloud Tasks"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { t.Error("h ran") })
			r := taskRequest("invoices", "inv-4", 0, `{}`)
			c.edit(r.Header)
			if name == "app engine no id" {
				r.Header.Del("X-CloudTasks-TaskName")
			}
			w := deliverTask(idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard())), r)
			if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), c.want) || s.Len() != 0 || s.Calls(fake.OpClaim) != 0 {
				t.Fatalf("%d %q, records %d; want 400 saying %q, nothing claimed", w.Code, w.Body, s.Len(), c.want)
			}
		})
	}
}

// A task of an App Engine queue carries its metadata in X-AppEngine-
// headers: it is keyed as the same task with X-CloudTasks- headers would
// be, so a retry in either form is a duplicate.
func TestTaskHandlerReadsAppEngineTaskHeaders(t *testing.T) {
	s, _ := newStore(t)
	var runs atomic.Int32
	var task idempotency.Task
	th := idempotency.TaskHandler(s, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) }),
		idempotency.WithLogger(newDiscard()),
		idempotency.WithKey(func(e cloudevents.Event) (string, error) {
			var err error
			task, err = idempotency.ParseTask(e)
			if err != nil {
				return "", err
			}
			return idempotency.DefaultKey()(e)
		}))
	r := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("x"))
	for k, v := range map[string]string{"X-AppEngine-QueueName": "default", "X-AppEngine-TaskName": "ae-1", "X-AppEngine-TaskRetryCount": "3", "X-AppEngine-TaskExecutionCount": "2", "X-AppEngine-TaskETA": "1764417600.5"} {
		r.Header.Set(k, v)
	}
	if w := deliverTask(th, r); w.Code != http.StatusOK || runs.Load() != 1 {
		t.Fatalf("App Engine task: %d runs %d, want h's 200", w.Code, runs.Load())
	}
	want := idempotency.Task{Queue: "default", Name: "ae-1", RetryCount: 3, ExecutionCount: 2, ETA: time.Unix(1764417600, 5e8).UTC()}
	if task != want {
		t.Fatalf("ParseTask: %+v, want %+v", task, want)
	}
	if _, ok := s.Record(taskKey("default", "ae-1")); !ok {
		t.Fatalf("no record under %q", taskKey("default", "ae-1"))
	}
	if w := deliverTask(th, taskRequest("default", "ae-1", 4, "x")); w.Code != http.StatusNoContent || runs.Load() != 1 {
		t.Fatalf("the same task with X-CloudTasks- headers: %d runs %d; want 204, not run", w.Code, runs.Load())
	}
}

// ParseTask refuses an event that TaskHandler did not make.
func TestParseTaskRefusesOtherEvents(t *testing.T) {
	e := cloudevents.NewEvent()
	e.SetID("1")
	e.SetSource("//storage.googleapis.com/projects/_/buckets/b")
	e.SetType("google.cloud.storage.object.v1.finalized")
	if _, err := idempotency.ParseTask(e); !errors.Is(err, idempotency.ErrMalformedEvent) {
		t.Fatalf("ParseTask: %v, want ErrMalformedEvent", err)
	}
}

// A backend that fails to claim is a 500: Cloud Tasks retries it with
// the queue's backoff, and nothing runs.
func TestTaskHandlerClaimFailureIs500(t *testing.T) {
	s, _ := newStore(t)
	s.FailNext(fake.OpClaim, errors.New("store unreachable"))
	th := idempotency.TaskHandler(s, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { t.Error("h ran") }), idempotency.WithLogger(newDiscard()))
	if w := deliverTask(th, taskRequest("q", "t", 0, "")); w.Code != http.StatusInternalServerError || !strings.Contains(w.Body.String(), "store unreachable") {
		t.Fatalf("%d %q, want 500 naming the failure", w.Code, w.Body)
	}
}

// With WithFingerprint on, a task name reused for another body after the
// first was done is a 409, not a duplicate: h does not run.
func TestTaskHandlerPayloadMismatchIs409(t *testing.T) {
	s, _ := newStore(t)
	var runs atomic.Int32
	th := idempotency.TaskHandler(s, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) }),
		idempotency.WithLogger(newDiscard()), idempotency.WithFingerprint(func(e cloudevents.Event) (string, error) {
			return fmt.Sprintf("task-body-v1:%x", sha256.Sum256(e.Data())), nil
		}))
	deliverTask(th, taskRequest("q", "t", 0, `{"amount":1}`))
	if w := deliverTask(th, taskRequest("q", "t", 1, `{"amount":2}`)); w.Code != http.StatusConflict || runs.Load() != 1 {
		t.Fatalf("%d runs %d, want 409 and one run", w.Code, runs.Load())
	}
}

// WithPushAuth verifies every task request before anything is read or
// claimed: a refused one is a 401 (or a 403), an accepted one runs.
func TestTaskHandlerWithPushAuth(t *testing.T) {
	s, _ := newStore(t)
	var runs atomic.Int32
	th := idempotency.TaskHandler(s, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) }),
		idempotency.WithLogger(newDiscard()),
		idempotency.WithPushAuth(func(r *http.Request) error {
			switch r.Header.Get("Authorization") {
			case "Bearer tasks-sa":
				return nil
			case "Bearer other-sa":
				return idempotency.ErrPushForbidden
			}
			return errors.New("no token")
		}))
	for auth, want := range map[string]int{"": http.StatusUnauthorized, "Bearer other-sa": http.StatusForbidden} {
		r := taskRequest("q", "t", 0, "")
		r.Header.Set("Authorization", auth)
		if w := deliverTask(th, r); w.Code != want || s.Len() != 0 || runs.Load() != 0 {
			t.Fatalf("auth %q: %d, records %d; want %d, nothing claimed", auth, w.Code, s.Len(), want)
		}
	}
	r := taskRequest("q", "t", 0, "")
	r.Header.Set("Authorization", "Bearer tasks-sa")
	if w := deliverTask(th, r); w.Code != http.StatusOK || runs.Load() != 1 {
		t.Fatalf("authenticated: %d runs %d, want 200", w.Code, runs.Load())
	}
}

// TaskHandler panics on the mistakes of a program, at start-up.
func TestTaskHandlerPanicsOnMistakes(t *testing.T) {
	s, _ := newStore(t)
	ok := http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})
	for name, f := range map[string]func(){
		"nil handler":       func() { idempotency.TaskHandler(s, nil) },
		"nil backend":       func() { idempotency.TaskHandler(nil, ok) },
		"unwrapped push":    func() { idempotency.TaskHandler(s, ok, idempotency.WithUnwrappedPush()) },
		"nil push verifier": func() { idempotency.TaskHandler(s, ok, idempotency.WithPushAuth(nil)) },
		"nil tx handler":    func() { idempotency.TaskHandlerTx[*ledgerTx](nil, nil) },
		"tx, unwrapped": func() {
			b, _, _ := newTxStore(t)
			idempotency.TaskHandlerTx(b, func(http.ResponseWriter, *http.Request, *ledgerTx) {}, idempotency.WithUnwrappedPush())
		},
	} {
		func() {
			defer func() {
				if p := recover(); p == nil || !strings.Contains(fmt.Sprint(p), "idempotency.TaskHandler") {
					t.Errorf("%s: panic %v, want one naming TaskHandler", name, p)
				}
			}()
			f()
		}()
	}
}

// No two distinct (queue, task) pairs share a key: each pair below is
// delivered once to one store, and every one that is accepted runs (none
// is taken for a duplicate), though their queue and task names,
// concatenated, are the same text. A queue name that cannot stand in a
// URI (no Cloud Tasks queue id can hold a pipe) is refused with a 400.
func TestTaskHandlerDistinctTasksNeverShareAKey(t *testing.T) {
	pairs := [][2]string{
		{"a|b", "c"}, {"a", "b|c"}, {"a", "b\\|c"}, {"a\\", "b|c"}, {"a\\|b", "c"}, {"a\\", "|b|c"},
		{"a", "b"}, {"a|", "b"}, {"a", "|b"}, {"a\\\\", "b"}, {"a", "\\\\b"}, {"a/b", "c"}, {"a", "b/c"},
		{"a-b", "c"}, {"a", "-b-c"}, {"a", "b_c"}, {"a-b-c", ""},
	}
	s, _ := newStore(t)
	var runs atomic.Int32
	th := idempotency.TaskHandler(s, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1) }), idempotency.WithLogger(newDiscard()))
	accepted := 0
	for _, p := range pairs {
		w := deliverTask(th, taskRequest(p[0], p[1], 0, ""))
		switch {
		case w.Code == http.StatusOK:
			accepted++
		case w.Code == http.StatusBadRequest && (p[1] == "" || strings.Contains(w.Body.String(), "cannot be part of a URI")):
		default:
			t.Fatalf("%q: %d %q, want h's 200 (or a 400 for a queue name no URI holds)", p, w.Code, w.Body)
		}
	}
	if accepted < len(pairs)/2 || int(runs.Load()) != accepted || s.Len() != accepted {
		t.Fatalf("accepted %d of %d, runs %d, records %d; want every accepted pair run once", accepted, len(pairs), runs.Load(), s.Len())
	}
}

// FuzzTaskKeyIsInjective checks, through the event TaskHandler makes of
// the request, that two distinct (queue, task) pairs never get one key.
func FuzzTaskKeyIsInjective(f *testing.F) {
	f.Add("a|b", "c", "a", "b|c")
	f.Add("a\\", "|b", "a", "\\|b")
	f.Add("q", "t", "q", "t")
	keyOf := func(t *testing.T, queue, task string) (string, bool) {
		var key string
		th := idempotency.TaskHandler(fake.New(), http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}),
			idempotency.WithLogger(newDiscard()),
			idempotency.WithKey(func(e cloudevents.Event) (string, error) {
				k, err := idempotency.DefaultKey()(e)
				key = k
				return k, err
			}))
		w := deliverTask(th, taskRequest(queue, task, 0, ""))
		return key, w.Code == http.StatusOK
	}
	f.Fuzz(func(t *testing.T, q1, t1, q2, t2 string) {
		k1, ok1 := keyOf(t, q1, t1)
		k2, ok2 := keyOf(t, q2, t2)
		if !ok1 || !ok2 {
			return // refused (empty, not UTF-8, too long): no key at all
		}
		if (k1 == k2) != (q1 == q2 && t1 == t2) {
			t.Fatalf("(%q, %q) -> %q and (%q, %q) -> %q", q1, t1, k1, q2, t2, k2)
		}
	})
}

// The client of TaskHandler's context: h's request carries the claim's
// context, which ends when the request does.
func TestTaskHandlerGivesHTheRequestContext(t *testing.T) {
	s, _ := newStore(t)
	type ctxKey struct{}
	var got any
	th := idempotency.TaskHandler(s, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got = r.Context().Value(ctxKey{}) }), idempotency.WithLogger(newDiscard()))
	r := taskRequest("q", "t", 0, "")
	r = r.WithContext(context.WithValue(r.Context(), ctxKey{}, "caller's"))
	deliverTask(th, r)
	if got != "caller's" {
		t.Fatalf("h's context value %v, want the request's", got)
	}
}

// TaskHandlerTx runs h in the store's transaction that marks the task
// done: a 2xx commits h's writes with the mark and is written only after
// the commit; a failing answer rolls the writes back and releases the
// claim; a commit that fails after h answered 2xx is a 500, and the
// client never sees h's 2xx; a retry of the done task is a 204.
func TestTaskHandlerTxCommitsTheWritesWithTheTask(t *testing.T) {
	b, l, _ := newTxStore(t)
	var runs atomic.Int32
	h := func(w http.ResponseWriter, r *http.Request, tx *ledgerTx) {
		body, _ := io.ReadAll(r.Body)
		tx.rows = append(tx.rows, string(body))
		if runs.Add(1) == 1 {
			http.Error(w, "partner refused", http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, "charged")
	}
	th := idempotency.TaskHandlerTx(b, h, idempotency.WithLogger(newDiscard()))
	key := taskKey("payments", "charge-1")
	if w := deliverTask(th, taskRequest("payments", "charge-1", 0, "charge 10")); w.Code != http.StatusBadGateway || w.Body.String() != "partner refused\n" || len(l.committed()) != 0 {
		t.Fatalf("failing attempt: %d %q, committed %q; want h's 502, nothing committed", w.Code, w.Body, l.committed())
	}
	assertReleased(t, b.Store, key)
	l.commitErr = errors.New("commit lost")
	if w := deliverTask(th, taskRequest("payments", "charge-1", 1, "charge 10")); w.Code != http.StatusInternalServerError || strings.Contains(w.Body.String(), "charged") || len(l.committed()) != 0 {
		t.Fatalf("attempt whose commit failed: %d %q, committed %q; want a 500 without h's answer, nothing committed", w.Code, w.Body, l.committed())
	}
	if w := deliverTask(th, taskRequest("payments", "charge-1", 2, "charge 10")); w.Code != http.StatusCreated || w.Body.String() != "charged" {
		t.Fatalf("third attempt: %d %q, want h's 201", w.Code, w.Body)
	}
	if w := deliverTask(th, taskRequest("payments", "charge-1", 3, "charge 10")); w.Code != http.StatusNoContent || runs.Load() != 3 {
		t.Fatalf("retry of the done task: %d, runs %d; want 204, h not run", w.Code, runs.Load())
	}
	if got := l.committed(); len(got) != 1 || got[0] != "charge 10" {
		t.Fatalf("committed %q, want the charge once", got)
	}
	if rec, ok := b.Record(key); !ok || rec.State != store.Done {
		t.Fatalf("record %+v %v, want done", rec, ok)
	}
}
