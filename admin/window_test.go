package admin_test

import (
	"context"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/admin"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// records is a Lister of fixed records, one page.
type records []store.Record

func (rs records) List(_ context.Context, q store.ListQuery) (store.Page, error) {
	var p store.Page
	for _, r := range rs {
		if q.State == 0 || r.State == q.State {
			p.Records = append(p.Records, r)
		}
	}
	return p, nil
}

// A Done record that stores no completion time (its expires-at is
// store.MaxInstant: redislock reports so a key someone PERSISTed, done for
// good) is outside every window of completion time: its computed
// completion, MaxInstant - ttl, is no completion time at all, and a
// forget of the keys "done since the bad deploy" must not rerun work done
// before it. On main it fell in any window with DoneFrom alone.
func TestPlanWindowLeavesOutARecordWithoutACompletionTime(t *testing.T) {
	now := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	lister := records{
		{Key: "orders:persisted", State: store.Done, Fence: 1, ExpiresAt: store.MaxInstant, Version: "0123456789abcdef", Now: now},
		{Key: "orders:recent", State: store.Done, Fence: 1, ExpiresAt: now.Add(50 * time.Minute), Version: "0123456789abcdef", Now: now},
	}
	plan, err := admin.Plan(context.Background(), lister, admin.Filter{Prefix: "orders:", DoneFrom: now.Add(-time.Hour), TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if len(plan) != 1 || plan[0].Key != "orders:recent" {
		t.Errorf("plan of the keys done in the last hour: %v, want orders:recent only", plan)
	}
	plan, err = admin.Plan(context.Background(), lister, admin.Filter{Prefix: "orders:", TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if len(plan) != 2 {
		t.Errorf("plan without a window: %v, want both records", plan)
	}
}
