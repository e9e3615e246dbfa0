package idempotency_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/metrics"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

// pushBody is a push envelope of message id whose body is about size
// bytes: its data is size*3/4 bytes (base64 makes it size).
func pushBody(id string, size int) []byte {
	data := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte("x"), max(1, (size-300)*3/4)))
	return []byte(`{"message":{"attributes":{"po_id":"PO-1"},"data":"` + data + `","messageId":"` + id +
		`","publishTime":"2026-11-29T12:00:00Z"},"subscription":"projects/p/subscriptions/s","deliveryAttempt":1}`)
}

// heapPeak samples the heap's object bytes while it runs, from a
// goroutine of its own, and keeps the highest.
type heapPeak struct {
	stop, done chan struct{}
	peak       atomic.Uint64
}

func heapObjects() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

func startHeapPeak() *heapPeak {
	p := &heapPeak{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		for {
			if v := heapObjects(); v > p.peak.Load() {
				p.peak.Store(v)
			}
			select {
			case <-p.stop:
				return
			default:
				time.Sleep(20 * time.Microsecond)
			}
		}
	}()
	return p
}

func (p *heapPeak) end() uint64 {
	close(p.stop)
	<-p.done
	if v := heapObjects(); v > p.peak.Load() {
		p.peak.Store(v)
	}
	return p.peak.Load()
}

// BenchmarkPushMemory measures the memory one push of 1 KiB, 1 MiB and
// 15 MiB costs, the handler's own ParsePubSub included: through
// PushHandler (a raw push envelope, and an Eventarc binary CloudEvent)
// and through Idempotent behind the CloudEvents HTTP handler the
// functions framework builds. B/op is every byte allocated per push;
// body-x is B/op over the body's size; peak-B is the largest growth of the
// live heap during one push over the heap after a collection before it,
// sampled every few tens of microseconds (only at 1 MiB and up, where a
// push lasts long enough to sample).
func BenchmarkPushMemory(b *testing.B) {
	handler := func(_ context.Context, e cloudevents.Event) error {
		ev, err := idempotency.ParsePubSub(e)
		if err != nil {
			return err
		}
		if len(ev.Message.Data) == 0 {
			return fmt.Errorf("no data")
		}
		return nil
	}
	binary := func(r *http.Request, id string) {
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set("Ce-Id", id)
		r.Header.Set("Ce-Source", "//pubsub.googleapis.com/projects/p/topics/t")
		r.Header.Set("Ce-Specversion", "1.0")
		r.Header.Set("Ce-Type", idempotency.PubSubEventType)
	}
	for _, size := range []int{1 << 10, 1 << 20, 15 << 20} {
		for _, path := range []struct {
			name string
			h    func() http.Handler
			ok   int
			head func(*http.Request, string)
		}{
			{"PushHandler-envelope", func() http.Handler {
				return idempotency.PushHandler(fake.New(), handler, idempotency.WithLogger(quiet))
			}, http.StatusNoContent, func(*http.Request, string) {}},
			{"PushHandler-binary", func() http.Handler {
				return idempotency.PushHandler(fake.New(), handler, idempotency.WithLogger(quiet))
			}, http.StatusNoContent, binary},
			{"Idempotent-receiver", func() http.Handler {
				return receiver(b, idempotency.Idempotent(fake.New(), idempotency.WithLogger(quiet))(handler))
			}, http.StatusOK, binary},
		} {
			b.Run(fmt.Sprintf("%s/body=%dKiB", path.name, size>>10), func(b *testing.B) {
				h := path.h()
				i := 0
				var peak uint64
				b.ReportAllocs()
				b.SetBytes(int64(size))
				for b.Loop() {
					b.StopTimer()
					i++
					id := strconv.Itoa(i)
					body := pushBody(id, size)
					r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
					r.ContentLength = int64(len(body))
					path.head(r, id)
					w := httptest.NewRecorder()
					var p *heapPeak
					var base uint64
					if size >= 1<<20 {
						runtime.GC()
						base = heapObjects()
						p = startHeapPeak()
					}
					b.StartTimer()
					h.ServeHTTP(w, r)
					b.StopTimer()
					if p != nil {
						peak = max(peak, p.end()-min(base, p.peak.Load()))
					}
					if w.Code != path.ok {
						b.Fatalf("HTTP %d: %s", w.Code, w.Body)
					}
					b.StartTimer()
				}
				if peak > 0 {
					b.ReportMetric(float64(peak), "peak-B")
				}
			})
		}
	}
}

// A 4 MiB push through PushHandler, as a raw envelope and as a binary
// CloudEvent, to a handler that calls ParsePubSub, allocates at most 2.5
// times its body: the body (read into 1 MiB, then into its
// Content-Length) and the data ParsePubSub decodes (three quarters of
// it). On main before it allocated about 5.1 times the body
// (the body read by doubling, a string copy, the SDK's or a compacting
// marshal's copy, and the data decoded for the fingerprint).
func TestPushAllocatesAboutOneCopyOfTheBody(t *testing.T) {
	const size = 4 << 20
	h := idempotency.PushHandler(fake.New(), func(_ context.Context, e cloudevents.Event) error {
		_, err := idempotency.ParsePubSub(e)
		return err
	}, idempotency.WithLogger(quiet))
	for _, binary := range []bool{false, true} {
		body := pushBody("m-1", size)
		r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
		r.ContentLength = int64(len(body))
		if binary {
			r.Header.Set("Content-Type", "application/json")
			r.Header.Set("Ce-Id", "m-1")
			r.Header.Set("Ce-Source", "//pubsub.googleapis.com/projects/p/topics/t")
			r.Header.Set("Ce-Specversion", "1.0")
			r.Header.Set("Ce-Type", idempotency.PubSubEventType)
		}
		w := httptest.NewRecorder()
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		h.ServeHTTP(w, r)
		runtime.ReadMemStats(&after)
		if w.Code != http.StatusNoContent {
			t.Fatalf("HTTP %d: %s", w.Code, w.Body)
		}
		t.Logf("binary %v: %d bytes allocated for a body of %d", binary, after.TotalAlloc-before.TotalAlloc, len(body))
		if got := after.TotalAlloc - before.TotalAlloc; got > 5*uint64(len(body))/2 {
			t.Errorf("binary %v: one push of %d bytes allocated %d bytes (%.1fx), want at most 2.5x", binary, len(body), got, float64(got)/float64(len(body)))
		}
		h = idempotency.PushHandler(fake.New(), func(_ context.Context, e cloudevents.Event) error {
			_, err := idempotency.ParsePubSub(e)
			return err
		}, idempotency.WithLogger(quiet))
	}
}

// A request that claims a body of MaxPushBody bytes and sends a few costs
// the read-ahead (1 MiB), not what it claims: the bytes that arrive, not
// the Content-Length, pay for the buffer.
func TestPushBodyBufferIsPaidForByTheBytesThatArrive(t *testing.T) {
	h := idempotency.PushHandler(fake.New(), func(context.Context, cloudevents.Event) error { return nil }, idempotency.WithLogger(quiet))
	body := pushBody("m-1", 1<<10)
	r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
	r.ContentLength = idempotency.MaxPushBody
	w := httptest.NewRecorder()
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	h.ServeHTTP(w, r)
	runtime.ReadMemStats(&after)
	if got := after.TotalAlloc - before.TotalAlloc; got > 3<<19 {
		t.Fatalf("a request claiming %d bytes and sending %d allocated %d bytes, want at most 1.5 MiB", r.ContentLength, len(body), got)
	}
}
