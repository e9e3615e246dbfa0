package idempotency_test

import (
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency"
)

// maxCompositeExtraAllocs is the most allocations CompositeKey of two JSON
// fields may add to one JSONField (measured: 4): the slice of the fields'
// JSON values, the tuple of part values, the second field's value, and the
// joined key. Decoding the envelope and the payload a second time, as two
// JSONFields do, costs about 47.
const maxCompositeExtraAllocs = 4

// CompositeKey decodes the envelope and the payload once, whatever the
// number of JSON parts: two fields of one object cost at most
// maxCompositeExtraAllocs allocations more than one JSONField, and fewer
// than two.
func TestCompositeKeyDecodesThePayloadOnce(t *testing.T) {
	e := compositeEvent(t, map[string]string{"tenant": "acme"}, `{"order":{"id":"PO-1","line":"7","qty":3,"note":"a note that is not read"}}`)
	allocs := func(kf idempotency.KeyFunc) float64 {
		return testing.AllocsPerRun(200, func() {
			if k, err := kf(e); err != nil || k == "" {
				t.Fatal(k, err)
			}
		})
	}
	one := allocs(idempotency.JSONField("order", "id"))
	two := allocs(idempotency.JSONField("order", "line")) + one
	composite := allocs(idempotency.CompositeKey(idempotency.JSONFieldPart("order", "id"), idempotency.JSONFieldPart("order", "line")))
	withAttr := allocs(idempotency.CompositeKey(idempotency.AttributePart("tenant"), idempotency.JSONFieldPart("order", "id"), idempotency.JSONFieldPart("order", "line")))
	t.Logf("allocations: one JSONField %.0f, two %.0f, CompositeKey of both %.0f, and an attribute %.0f", one, two, composite, withAttr)
	if composite > one+maxCompositeExtraAllocs+raceAllocSlack || composite >= two {
		t.Errorf("CompositeKey of two fields: %.0f allocations; one JSONField %.0f, two %.0f: want at most %.0f", composite, one, two, one+maxCompositeExtraAllocs)
	}
	if withAttr > composite+raceAllocSlack {
		t.Errorf("an attribute part costs %.0f allocations", withAttr-composite)
	}
}

// BenchmarkCompositeKey measures CompositeKey beside the single KeyFuncs
// it is made of.
func BenchmarkCompositeKey(b *testing.B) {
	e := compositeEvent(b, map[string]string{"tenant": "acme"}, `{"order":{"id":"PO-1","line":"7","qty":3}}`)
	for _, c := range []struct {
		name string
		kf   idempotency.KeyFunc
	}{
		{"Attribute", idempotency.Attribute("tenant")},
		{"JSONField", idempotency.JSONField("order", "id")},
		{"CompositeKey/attribute+2 fields", idempotency.CompositeKey(idempotency.AttributePart("tenant"), idempotency.JSONFieldPart("order", "id"), idempotency.JSONFieldPart("order", "line"))},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if k, err := c.kf(e); err != nil || k == "" {
					b.Fatal(k, err)
				}
			}
		})
	}
}
