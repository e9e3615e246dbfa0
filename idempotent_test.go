package idempotency_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
	"github.com/google/go-cmp/cmp"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// pubsubEvent builds a Pub/Sub CloudEvent with the given message fields.
func pubsubEvent(t *testing.T, id string, message map[string]any) cloudevents.Event {
	t.Helper()
	e := cloudevents.NewEvent()
	e.SetID(id)
	e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
	e.SetType(idempotency.PubSubEventType)
	if err := e.SetData(cloudevents.ApplicationJSON, map[string]any{"message": message}); err != nil {
		t.Fatal(err)
	}
	return e
}

func payload(v any) string {
	b, _ := json.Marshal(v)
	return base64.StdEncoding.EncodeToString(b)
}

func TestParsePubSub(t *testing.T) {
	e := cloudevents.NewEvent()
	e.SetID("ce-1")
	e.SetType(idempotency.PubSubEventType)
	e.SetSource("//pubsub.googleapis.com/projects/p/topics/t")
	e.SetData(cloudevents.ApplicationJSON, map[string]any{
		"message": map[string]any{
			"messageId":   "m-1",
			"data":        payload("hi"),
			"attributes":  map[string]string{"a": "b"},
			"orderingKey": "ok-1",
			"publishTime": "2026-11-29T12:00:00.5Z",
		},
		"subscription":    "projects/p/subscriptions/s",
		"deliveryAttempt": 3,
	})
	got, err := idempotency.ParsePubSub(e)
	if err != nil {
		t.Fatal(err)
	}
	want := idempotency.PubSubEvent{
		Message: idempotency.PubSubMessage{
			ID:          "m-1",
			Data:        []byte(`"hi"`),
			Attributes:  map[string]string{"a": "b"},
			OrderingKey: "ok-1",
			PublishTime: epoch.Add(500 * time.Millisecond),
		},
		Subscription:    "projects/p/subscriptions/s",
		DeliveryAttempt: 3,
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("(-want +got):\n%s", diff)
	}
}

func TestMessageIDResolutionOrder(t *testing.T) {
	key := idempotency.MessageID()
	cases := []struct {
		name    string
		typ     string
		message map[string]any
		want    string
	}{
		{"messageId first", idempotency.PubSubEventType, map[string]any{"messageId": "a", "message_id": "b"}, "a"},
		{"then message_id", idempotency.PubSubEventType, map[string]any{"message_id": "b"}, "b"},
		{"then the CloudEvent id for a Pub/Sub event", idempotency.PubSubEventType, map[string]any{}, "ce-id"},
		{"no fallback for another type", "com.example.v1", map[string]any{}, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := pubsubEvent(t, "ce-id", c.message)
			e.SetType(c.typ)
			got, err := key(e)
			if err != nil || got != c.want {
				t.Fatalf("key = %q, %v; want %q", got, err, c.want)
			}
		})
	}
}

func TestMalformedEventsAreErrors(t *testing.T) {
	notJSON := cloudevents.NewEvent()
	notJSON.SetID("x")
	notJSON.SetData("text/plain", []byte("hello"))
	noMessage := cloudevents.NewEvent()
	noMessage.SetID("y")
	noMessage.SetData(cloudevents.ApplicationJSON, map[string]any{"subscription": "s"})
	badBase64 := cloudevents.NewEvent()
	badBase64.SetID("z")
	badBase64.SetData(cloudevents.ApplicationJSON, map[string]any{"message": map[string]any{"data": "%%%"}})
	for name, e := range map[string]cloudevents.Event{"not JSON": notJSON, "no message": noMessage} {
		if _, err := idempotency.MessageID()(e); !errors.Is(err, idempotency.ErrMalformedEvent) {
			t.Errorf("MessageID, %s: err = %v, want ErrMalformedEvent", name, err)
		}
	}
	for name, e := range map[string]cloudevents.Event{"not JSON": notJSON, "no message": noMessage, "bad base64": badBase64} {
		if _, err := idempotency.ParsePubSub(e); !errors.Is(err, idempotency.ErrMalformedEvent) {
			t.Errorf("ParsePubSub, %s: err = %v, want ErrMalformedEvent", name, err)
		}
	}
	// The default key reads only the ids: a payload it cannot decode is the
	// handler's business, not a reason to refuse the delivery.
	if k, err := idempotency.MessageID()(badBase64); k != "" || err != nil {
		t.Errorf("MessageID of a bad payload without ids = %q, %v; want unkeyed", k, err)
	}
}

func TestAttributeKey(t *testing.T) {
	e := pubsubEvent(t, "1", map[string]any{"messageId": "1", "attributes": map[string]string{"po_id": "PO-7"}})
	if k, err := idempotency.Attribute("po_id")(e); k != "PO-7" || err != nil {
		t.Fatalf("Attribute(po_id) = %q, %v", k, err)
	}
	if k, err := idempotency.Attribute("missing")(e); k != "" || err != nil {
		t.Fatalf("Attribute(missing) = %q, %v; want unkeyed", k, err)
	}
}

func TestJSONFieldKey(t *testing.T) {
	e := pubsubEvent(t, "1", map[string]any{"messageId": "1", "data": payload(map[string]any{
		"order": map[string]any{"id": "PO-9", "n": 12345678901234567, "paid": true, "none": nil, "lines": []int{1}},
	})})
	cases := []struct {
		path    []string
		want    string
		wantErr bool
	}{
		{[]string{"order", "id"}, "PO-9", false},
		{[]string{"order", "n"}, "12345678901234567", false}, // no float rounding
		{[]string{"order", "paid"}, "true", false},
		{[]string{"order", "none"}, "", false},
		{[]string{"order", "absent"}, "", false},
		{[]string{"order", "id", "deeper"}, "", false},
		{[]string{"order", "lines"}, "", true},
		{[]string{"order"}, "", true},
	}
	for _, c := range cases {
		got, err := idempotency.JSONField(c.path...)(e)
		if got != c.want || (err != nil) != c.wantErr {
			t.Errorf("JSONField(%q) = %q, %v; want %q, error %v", c.path, got, err, c.want, c.wantErr)
		}
	}
	notJSON := pubsubEvent(t, "2", map[string]any{"messageId": "2", "data": base64.StdEncoding.EncodeToString([]byte("<xml/>"))})
	if _, err := idempotency.JSONField("id")(notJSON); !errors.Is(err, idempotency.ErrMalformedEvent) {
		t.Fatalf("non-JSON payload: %v, want ErrMalformedEvent", err)
	}
}

func TestIdempotentCustomKeyOverride(t *testing.T) {
	s, _ := newStore(t)
	runs := 0
	h := idempotency.Idempotent(s, idempotency.WithKey(func(e cloudevents.Event) (string, error) {
		return "custom:" + e.Subject(), nil
	}))(func(context.Context, cloudevents.Event) error { runs++; return nil })
	for _, id := range []string{"m-1", "m-2"} {
		e := pubsubEvent(t, id, map[string]any{"messageId": id})
		e.SetSubject("PO-1")
		if err := h(t.Context(), e); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := s.Record("custom:PO-1"); !ok || runs != 1 {
		t.Fatalf("runs = %d, record present = %v; want one run under the custom key", runs, ok)
	}
}

func TestIdempotentKeyFuncErrorNacksWithoutRunning(t *testing.T) {
	s, _ := newStore(t)
	boom := errors.New("lookup failed")
	h := idempotency.Idempotent(s, idempotency.AllowUnguarded(), idempotency.WithKey(func(cloudevents.Event) (string, error) {
		return "", boom
	}))(func(context.Context, cloudevents.Event) error { t.Error("handler ran"); return nil })
	if err := h(t.Context(), pubsubEvent(t, "1", map[string]any{})); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want the key func's error", err)
	}
}

func TestIdempotentOnDuplicateHookNeverChangesTheAck(t *testing.T) {
	for name, hook := range map[string]func(context.Context, string) error{
		"returns an error": func(context.Context, string) error { return errors.New("metrics down") },
		"panics":           func(context.Context, string) error { panic("hook bug") },
		"succeeds":         func(context.Context, string) error { return nil },
	} {
		t.Run(name, func(t *testing.T) {
			s, _ := newStore(t)
			l, logger := newLogs()
			var seen []string
			h := idempotency.Idempotent(s, idempotency.WithLogger(logger),
				idempotency.OnDuplicate(func(ctx context.Context, key string) error {
					seen = append(seen, key)
					return hook(ctx, key)
				}))(func(context.Context, cloudevents.Event) error { return nil })
			e := pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"})
			if err := h(t.Context(), e); err != nil {
				t.Fatal(err)
			}
			if err := h(t.Context(), e); err != nil {
				t.Fatalf("duplicate with a hook that %s: %v, want nil (ack)", name, err)
			}
			if len(seen) != 1 || seen[0] != "m-1" {
				t.Fatalf("hook saw %v, want [m-1]", seen)
			}
			wantErrLogs := 1
			if name == "succeeds" {
				wantErrLogs = 0
			}
			if got := len(l.find(t, "ERROR", "on-duplicate hook")); got != wantErrLogs {
				t.Fatalf("%d hook error logs, want %d: %v", got, wantErrLogs, l.records(t))
			}
		})
	}
}

func TestIdempotentInnerMutexContentionIsA503(t *testing.T) {
	s, _ := newStore(t)
	s.Claim(t.Context(), "po:PO-1", time.Hour) // another update holds the entity
	h := idempotency.Idempotent(s)(func(ctx context.Context, e cloudevents.Event) error {
		return idempotency.Mutex(ctx, s, "po:PO-1", func(context.Context) error { return nil })
	})
	err := h(t.Context(), pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"}))
	var res *cehttp.Result
	if !errors.As(err, &res) || res.StatusCode != http.StatusServiceUnavailable || !errors.Is(err, idempotency.ErrInProgress) {
		t.Fatalf("err = %v, want a 503 result wrapping ErrInProgress", err)
	}
	// The message key was released, not completed: the retry runs.
	if rec, _ := s.Record("m-1"); rec.State != store.Claimed || rec.Fence != 2 {
		t.Fatalf("message record %+v, want released", rec)
	}
}

func TestIdempotentDisableSwitch(t *testing.T) {
	for _, v := range []string{"1", "true", "TRUE", "Yes", " on "} {
		t.Run(v, func(t *testing.T) {
			t.Setenv(idempotency.DisableEnv, v)
			l, logger := newLogs()
			runs := 0
			h := idempotency.Idempotent(untouchable(t), idempotency.WithLogger(logger))(
				func(context.Context, cloudevents.Event) error { runs++; return nil })
			e := pubsubEvent(t, "m-1", map[string]any{"messageId": "m-1"})
			h(t.Context(), e)
			h(t.Context(), e)
			if runs != 2 {
				t.Fatalf("runs = %d, want 2 (unguarded pass-through)", runs)
			}
			if got := len(l.find(t, "WARN", idempotency.DisableEnv)); got != 1 {
				t.Fatalf("%d warnings, want exactly one", got)
			}
		})
	}
	for _, v := range []string{"", "0", "false", "off", "disabled"} {
		t.Setenv(idempotency.DisableEnv, v)
		if idempotency.Disabled() {
			t.Errorf("Disabled() with %q = true", v)
		}
	}
	// Disabled, a nil backend is fine: nothing is ever built or called.
	t.Setenv(idempotency.DisableEnv, "1")
	idempotency.Idempotent(nil, idempotency.WithLogger(newDiscard()))
}

func newDiscard() *slog.Logger { _, l := newLogs(); return l }

func TestIdempotentPanicsOnProgrammingMistakes(t *testing.T) {
	s, _ := newStore(t)
	cases := map[string]func(){
		"nil backend":     func() { idempotency.Idempotent(nil) },
		"zero lease":      func() { idempotency.Idempotent(s, idempotency.WithLease(0)) },
		"nil key func":    func() { idempotency.Idempotent(s, idempotency.WithKey(nil)) },
		"NUL in prefix":   func() { idempotency.Idempotent(s, idempotency.WithKeyPrefix("a\x00")) },
		"nil handler":     func() { idempotency.Idempotent(s)(nil) },
		"negative settle": func() { idempotency.Idempotent(s, idempotency.WithSettleTimeout(-1)) },
	}
	for name, f := range cases {
		t.Run(name, func(t *testing.T) {
			defer func() {
				msg, _ := recover().(string)
				if !strings.HasPrefix(msg, "idempotency.Idempotent: ") {
					t.Fatalf("panic %q, want a message naming Idempotent", msg)
				}
			}()
			f()
		})
	}
}

func TestNewLogHandlerSpeaksCloudLogging(t *testing.T) {
	l := &logs{}
	logger := slog.New(idempotency.NewLogHandler(l, slog.LevelDebug))
	logger.Warn("held", "key", "k")
	logger.Error("broken")
	logger.Debug("detail")
	logger.WithGroup("g").Info("grouped", "level", "x")
	var got []string
	for _, r := range l.records(t) {
		got = append(got, r["severity"].(string)+":"+r["message"].(string))
	}
	if want := []string{"WARNING:held", "ERROR:broken", "DEBUG:detail", "INFO:grouped"}; !cmp.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}
