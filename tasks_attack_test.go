package idempotency_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// A status that net/http would not send as h's final answer is no
// success: net/http panics on a WriteHeader code outside 100..999 (a
// handler passing on a zero status from a failed call, say), and a 101
// written without taking over the connection is not a 2xx either. Behind
// TaskHandler, such an h must not complete the task, and the client must
// not see a 2xx: either h's call panics as it would under net/http (the
// claim is released and Cloud Tasks retries), or the attempt fails.
func TestTaskHandlerInvalidStatusFromHandlerIsNoSuccess(t *testing.T) {
	for _, code := range []int{0, -1, 99, 1000, http.StatusSwitchingProtocols} {
		t.Run(fmt.Sprint(code), func(t *testing.T) {
			s, _ := newStore(t)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(code)
				fmt.Fprint(w, "sent")
			})
			th := idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard()))
			w := httptest.NewRecorder()
			panicked := func() (p any) {
				defer func() { p = recover() }()
				th.ServeHTTP(w, taskRequest("invoices", "inv-status", 0, `{}`))
				return nil
			}()
			if rec, ok := s.Record(taskKey("invoices", "inv-status")); ok && rec.State == store.Done {
				t.Fatalf("h answered WriteHeader(%d): the task was marked done (client saw %d, panic %v); want it released for a retry", code, w.Code, panicked)
			}
			if panicked == nil && w.Code >= 200 && w.Code <= 299 {
				t.Fatalf("h answered WriteHeader(%d): the client saw %d, a success", code, w.Code)
			}
		})
	}
}

// What h sets in its header after it wrote the status is not sent, as
// net/http sends the header as it was at WriteHeader: the client sees
// the response h would have sent without TaskHandler.
func TestTaskHandlerSendsTheHeaderAsItWasAtWriteHeader(t *testing.T) {
	s, _ := newStore(t)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Before", "1")
		w.WriteHeader(http.StatusAccepted)
		w.Header().Set("X-After", "1")
		fmt.Fprint(w, "accepted")
	})
	want := httptest.NewRecorder()
	h.ServeHTTP(want, taskRequest("invoices", "inv-hdr", 0, `{}`))
	th := idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard()))
	got := deliverTask(th, taskRequest("invoices", "inv-hdr", 0, `{}`)).Result()
	if wantR := want.Result(); got.StatusCode != wantR.StatusCode || got.Header.Get("X-Before") != "1" || got.Header.Get("X-After") != wantR.Header.Get("X-After") {
		t.Fatalf("client saw %d %v; without TaskHandler %d %v", got.StatusCode, got.Header, wantR.StatusCode, wantR.Header)
	}
}

// A request whose Body is nil (http.NewRequest's, with no body, served
// by a test or a middleware that calls ServeHTTP itself; the net/http
// server never makes one) is a task with an empty body, not a panic.
func TestTaskHandlerServesARequestWithANilBody(t *testing.T) {
	s, _ := newStore(t)
	ran := false
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ran = true })
	th := idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard()))
	r, err := http.NewRequest(http.MethodPost, "http://example.com/tasks", nil)
	if err != nil {
		t.Fatal(err)
	}
	r.Header.Set("X-CloudTasks-QueueName", "invoices")
	r.Header.Set("X-CloudTasks-TaskName", "inv-nil")
	w := httptest.NewRecorder()
	func() {
		defer func() {
			if p := recover(); p != nil {
				t.Fatalf("TaskHandler panicked on a nil Body: %v", p)
			}
		}()
		th.ServeHTTP(w, r)
	}()
	if w.Code != http.StatusOK || !ran {
		t.Fatalf("client saw %d, h ran %v; want h's 200", w.Code, ran)
	}
}

// A TaskHandlerTx body the store runs twice (its first commit aborted)
// answers twice; the client
// sees the last answer alone (none of the aborted run's header, status or
// body), once, and only what the last run wrote commits.
func TestTaskHandlerTxWritesOnlyTheLastRunsResponse(t *testing.T) {
	for _, second := range []int{http.StatusCreated, http.StatusBadGateway} {
		t.Run(fmt.Sprint(second), func(t *testing.T) {
			inner, l, _ := newTxStore(t)
			b := retryOnce{inner}
			l.commitErr = errAborted // the first commit conflicts; the store runs the transaction again
			var runs atomic.Int32
			h := func(w http.ResponseWriter, r *http.Request, tx *ledgerTx) {
				body, _ := io.ReadAll(r.Body)
				n := runs.Add(1)
				tx.rows = append(tx.rows, fmt.Sprintf("%s (run %d)", body, n))
				if n == 1 {
					w.Header().Set("X-First-Run", "1")
					w.WriteHeader(http.StatusCreated)
					fmt.Fprint(w, "first ")
					return
				}
				w.WriteHeader(second)
				fmt.Fprint(w, "second")
			}
			th := idempotency.TaskHandlerTx[*ledgerTx](b, h, idempotency.WithLogger(newDiscard()))
			got := deliverTask(th, taskRequest("payments", "charge-rerun", 0, "charge 10")).Result()
			body, _ := io.ReadAll(got.Body)
			if runs.Load() != 2 || got.StatusCode != second || string(body) != "second" || got.Header.Get("X-First-Run") != "" {
				t.Fatalf("runs %d; client saw %d %q %v; want the second run's %d \"second\" alone", runs.Load(), got.StatusCode, body, got.Header, second)
			}
			rec, _ := inner.Record(taskKey("payments", "charge-rerun"))
			switch c := l.committed(); {
			case second == http.StatusCreated && (len(c) != 1 || c[0] != "charge 10 (run 2)" || rec.State != store.Done):
				t.Fatalf("committed %q, record %+v; want the second run's row and the task done", c, rec)
			case second != http.StatusCreated && (len(c) != 0 || rec.State != store.Claimed):
				t.Fatalf("committed %q, record %+v; want nothing and the task released", c, rec)
			}
		})
	}
}

// An h that panics after writing a 2xx, over a real connection: the
// client gets no response at all (net/http drops the connection; nothing
// was sent before the claim settled), and the claim is released for Cloud
// Tasks' retry. http.ErrAbortHandler, which net/http does not log, too.
func TestTaskHandlerPanicAfterA2xxSendsNothing(t *testing.T) {
	for _, p := range []any{"ledger exploded", http.ErrAbortHandler} {
		t.Run(fmt.Sprint(p), func(t *testing.T) {
			s, _ := newStore(t)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusOK)
				fmt.Fprint(w, "charged")
				if f, ok := w.(http.Flusher); ok {
					f.Flush()
				}
				panic(p)
			})
			srv := httptest.NewUnstartedServer(idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard())))
			srv.Config.ErrorLog = log.New(io.Discard, "", 0)
			srv.Start()
			defer srv.Close()
			r := taskRequest("invoices", "inv-panic", 0, `{}`)
			req, err := http.NewRequest(http.MethodPost, srv.URL+"/tasks/invoice", r.Body)
			if err != nil {
				t.Fatal(err)
			}
			req.Header = r.Header
			resp, err := srv.Client().Do(req)
			if err == nil {
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				t.Fatalf("client got %d %q; want no response", resp.StatusCode, body)
			}
			assertReleased(t, s, taskKey("invoices", "inv-panic"))
		})
	}
}

// An ETA header that is no number of seconds is refused with a 400 before
// anything is claimed, NaN included (strconv.ParseFloat reads "NaN", and
// no comparison refuses it).
func TestTaskHandlerRefusesANaNETA(t *testing.T) {
	for _, eta := range []string{"NaN", "nan", "-NaN"} {
		t.Run(eta, func(t *testing.T) {
			s, _ := newStore(t)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { t.Error("h ran") })
			r := taskRequest("invoices", "inv-nan", 0, `{}`)
			r.Header.Set("X-CloudTasks-TaskETA", eta)
			w := deliverTask(idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard())), r)
			if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "is not a time") || s.Len() != 0 {
				t.Fatalf("ETA %q: %d %q, records %d; want 400, nothing claimed", eta, w.Code, w.Body, s.Len())
			}
		})
	}
}

// Trailers reach the client as net/http sends them: the values of the
// keys h declared in its Trailer header, and of http.TrailerPrefix keys,
// set after the body.
func TestTaskHandlerPassesTrailersOn(t *testing.T) {
	s, _ := newStore(t)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Checksum")
		w.WriteHeader(http.StatusOK)
		fmt.Fprint(w, "sent")
		w.Header().Set("X-Checksum", "abc")
		w.Header().Set(http.TrailerPrefix+"X-Rows", "1")
	})
	srv := httptest.NewServer(idempotency.TaskHandler(s, h, idempotency.WithLogger(newDiscard())))
	defer srv.Close()
	r := taskRequest("invoices", "inv-trailer", 0, `{}`)
	req, err := http.NewRequest(http.MethodPost, srv.URL, r.Body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header = r.Header
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "sent" || resp.Trailer.Get("X-Checksum") != "abc" || resp.Trailer.Get("X-Rows") != "1" || resp.Header.Get("X-Checksum") != "" {
		t.Fatalf("client saw %q, header %v, trailer %v; want the trailers as trailers", body, resp.Header, resp.Trailer)
	}
}
