package idempotency_test

import (
	"bytes"
	"io"
	"net/http"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// eventarcEvent is an Eventarc delivery in binary mode: the CloudEvent's
// attributes in Ce- headers, its data the body.
type eventarcEvent struct {
	name, id, source, typ, subject, contentType string
	ext                                         map[string]string // more Ce- headers
	body                                        []byte
}

// postEventarc posts ev to the functions framework serving the test's
// function, and returns the status.
func postEventarc(t *testing.T, ev eventarcEvent) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, serverURL+"/", bytes.NewReader(ev.body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", ev.contentType)
	req.Header.Set("Ce-Specversion", "1.0")
	req.Header.Set("Ce-Id", ev.id)
	req.Header.Set("Ce-Source", ev.source)
	req.Header.Set("Ce-Type", ev.typ)
	req.Header.Set("Ce-Subject", ev.subject)
	req.Header.Set("Ce-Time", "2026-11-29T12:00:00.123Z")
	for k, v := range ev.ext {
		req.Header.Set("Ce-"+k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// eventarcEvents are Eventarc events that are not Pub/Sub messages, as
// Eventarc posts them to a function: Cloud Storage (JSON data), Firestore
// (protobuf data, which the default key never reads) and Cloud Audit Logs.
var eventarcEvents = []eventarcEvent{
	{
		name: "storage", id: "7340129356201466", source: "//storage.googleapis.com/projects/_/buckets/invoices-inbox",
		typ: "google.cloud.storage.object.v1.finalized", subject: "objects/2026/11/INV-1002.pdf", contentType: "application/json",
		ext:  map[string]string{"Bucket": "invoices-inbox"},
		body: []byte(`{"kind":"storage#object","name":"2026/11/INV-1002.pdf","bucket":"invoices-inbox","generation":"1764417600123457"}`),
	},
	{
		name: "firestore", id: "0f6b8a9c-2d3e-4f50-8a1b-2c3d4e5f6a7b", source: "//firestore.googleapis.com/projects/acme/databases/(default)",
		typ: "google.cloud.firestore.document.v1.written", subject: "documents/orders/PO-1001", contentType: "application/protobuf",
		ext:  map[string]string{"Dataschema": "https://github.com/googleapis/google-cloudevents/blob/main/proto/google/events/cloud/firestore/v1/data.proto", "Database": "(default)", "Document": "orders/PO-1001", "Namespace": "(default)"},
		body: []byte{0x0a, 0x2a, 0x0a, 0x28, 'p', 'r', 'o', 'j', 'e', 'c', 't', 's', 0x00, 0xff, 0x12, 0x03, 0x01, 0x02, 0x03},
	},
	{
		name: "audit log", id: "projects/acme/logs/cloudaudit.googleapis.com%2Factivity-1x2y3z4w5v6u7-1764417600123456789", source: "//cloudaudit.googleapis.com/projects/acme/logs/activity",
		typ: "google.cloud.audit.log.v1.written", subject: "storage.googleapis.com/projects/_/buckets/invoices-inbox", contentType: "application/json",
		ext:  map[string]string{"Methodname": "storage.buckets.create", "Servicename": "storage.googleapis.com", "Resourcename": "projects/_/buckets/invoices-inbox", "Recordedtime": "2026-11-29T12:00:00.123456789Z"},
		body: []byte(`{"protoPayload":{"methodName":"storage.buckets.create","serviceName":"storage.googleapis.com"},"insertId":"1x2y3z4w5v6u7"}`),
	},
}

// A guarded function served by the functions framework keys each
// Eventarc event that is not a Pub/Sub message on its source and id:
// the second delivery of each is acked (200) without running the
// handler, and the record is done under source|id.
func TestFunctionsFrameworkAcksEventarcRedeliveriesUnrun(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s, idempotency.WithLogger(newDiscard()))(h.handle))
	for i, ev := range eventarcEvents {
		for delivery := 1; delivery <= 2; delivery++ {
			if code := postEventarc(t, ev); code != http.StatusOK {
				t.Fatalf("%s, delivery %d: HTTP %d, want 200", ev.name, delivery, code)
			}
			if h.runs() != i+1 {
				t.Fatalf("%s, delivery %d: runs %d, want %d (once per event)", ev.name, delivery, h.runs(), i+1)
			}
		}
		key := ev.source + "|" + ev.id
		if rec, ok := s.Record(key); !ok || rec.State != store.Done {
			t.Fatalf("%s: record %q %+v %v, want done", ev.name, key, rec, ok)
		}
		got := h.events[i]
		if got.Type() != ev.typ || got.Subject() != ev.subject || !bytes.Equal(got.Data(), ev.body) {
			t.Fatalf("%s: the handler saw %v, want the event as posted", ev.name, got)
		}
	}
}

// Two events with one id from two sources are two events (the
// CloudEvents spec makes only source and id together unique): both run.
func TestFunctionsFrameworkRunsEventsOfOneIDFromTwoSources(t *testing.T) {
	s, _ := newStore(t)
	h := &counting{}
	serve(t, idempotency.Idempotent(s, idempotency.WithLogger(newDiscard()))(h.handle))
	a := eventarcEvents[0]
	b := a
	b.source = "//storage.googleapis.com/projects/_/buckets/invoices-archive"
	c := eventarcEvents[2]
	c.id = a.id
	for _, ev := range []eventarcEvent{a, b, c, a, b, c} {
		if code := postEventarc(t, ev); code != http.StatusOK {
			t.Fatalf("%s from %s: HTTP %d, want 200", ev.name, ev.source, code)
		}
	}
	if h.runs() != 3 || s.Len() != 3 {
		t.Fatalf("runs %d, records %d; want 3 of each (one per source), the repeats acked unrun", h.runs(), s.Len())
	}
}
