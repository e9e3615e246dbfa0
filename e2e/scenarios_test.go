package e2e

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"
)

// orderScenario sets up a scenario: a project of its own, a supplier, n
// instances of target, and a topic "orders" with one push subscription.
func orderScenario(t *testing.T, name, target string, n int, extraEnv ...string) (*pubsub, *supplier, *fleet) {
	ps, sup := newPubSub(t, name), newSupplier(t)
	f := startFleet(t, n, env(t, ps, sup, target, extraEnv...)...)
	ps.topic(t, "orders")
	ps.subscribe(t, "orders-push", "orders", f.lb.URL)
	return ps, sup, f
}

func order(id string) map[string]any {
	return map[string]any{"order": map[string]any{"id": id, "qty": 1}}
}

func TestAckedMessageProcessesOnce(t *testing.T) {
	ps, sup, f := orderScenario(t, "acked", "HandleOrder", 2)
	ps.publish(t, "orders", map[string]string{"po_id": "PO-1"}, order("PO-1"))
	eventually(t, 30*time.Second, "the order at the supplier", func() bool { return sup.callsFor("orders:PO-1") == 1 })
	f.drained(t, 3*time.Second, 30*time.Second)
	if n := f.deliveries.Load(); n != 1 || sup.callsFor("orders:PO-1") != 1 {
		t.Fatalf("%d deliveries, %d supplier calls; want 1 and 1", n, sup.callsFor("orders:PO-1"))
	}
}

func TestSameMessageOnTwoSubscriptionsProcessesOnce(t *testing.T) {
	ps, sup := newPubSub(t, "twosubs"), newSupplier(t)
	f := startFleet(t, 2, env(t, ps, sup, "HandleOrder")...)
	ps.topic(t, "orders")
	ps.subscribe(t, "orders-a", "orders", f.lb.URL)
	ps.subscribe(t, "orders-b", "orders", f.lb.URL)
	ps.publish(t, "orders", map[string]string{"po_id": "PO-2"}, order("PO-2"))
	eventually(t, 30*time.Second, "both deliveries acked", func() bool { return f.statusCounts()[http.StatusOK] >= 2 })
	f.drained(t, 3*time.Second, 30*time.Second)
	if n := sup.callsFor("orders:PO-2"); n != 1 {
		t.Fatalf("the supplier got %d calls for one message on two subscriptions, want 1", n)
	}
}

func TestConcurrentDuplicatesProcessOnce(t *testing.T) {
	ps, sup, f := orderScenario(t, "concurrent", "HandleOrder", 4)
	var wg sync.WaitGroup
	for range 8 { // eight copies of one order at once, across four instances
		wg.Go(func() { ps.publish(t, "orders", map[string]string{"po_id": "PO-3"}, order("PO-3")) })
	}
	wg.Wait()
	eventually(t, 60*time.Second, "all eight acked", func() bool { return f.statusCounts()[http.StatusOK] >= 8 })
	f.drained(t, 3*time.Second, 30*time.Second)
	if n := sup.callsFor("orders:PO-3"); n != 1 {
		t.Fatalf("the supplier got %d calls, want 1 (statuses %v)", n, f.statusCounts())
	}
}

func TestTransientFailureNacksRetriesAndSucceedsOnce(t *testing.T) {
	ps, sup, f := orderScenario(t, "transient", "HandleOrder", 2)
	sup.mu.Lock()
	sup.failFirst["orders:PO-4"] = 2
	sup.mu.Unlock()
	ps.publish(t, "orders", map[string]string{"po_id": "PO-4"}, order("PO-4"))
	eventually(t, 60*time.Second, "the third attempt", func() bool { return f.statusCounts()[http.StatusOK] == 1 })
	f.drained(t, 3*time.Second, 30*time.Second)
	st := f.statusCounts()
	if sup.callsFor("orders:PO-4") != 3 || st[http.StatusInternalServerError] != 2 || st[http.StatusOK] != 1 {
		t.Fatalf("supplier calls %d, statuses %v; want 2 failures (500, redelivered) then one success",
			sup.callsFor("orders:PO-4"), st)
	}
}

func TestBusinessRepublishIsCaughtByTheBusinessKey(t *testing.T) {
	ps, sup, f := orderScenario(t, "republish", "HandleOrder", 2)
	a := ps.publish(t, "orders", map[string]string{"po_id": "PO-5"}, order("PO-5"))
	eventually(t, 30*time.Second, "the first publish", func() bool { return sup.callsFor("orders:PO-5") == 1 })
	b := ps.publish(t, "orders", map[string]string{"po_id": "PO-5"}, order("PO-5"))
	if a == b {
		t.Fatalf("the republish reused messageId %s", a)
	}
	eventually(t, 30*time.Second, "the republish acked", func() bool { return f.statusCounts()[http.StatusOK] == 2 })
	f.drained(t, 3*time.Second, 30*time.Second)
	if n := sup.callsFor("orders:PO-5"); n != 1 {
		t.Fatalf("the supplier got %d calls for an order published twice, want 1", n)
	}
}

func TestUnkeyedMessageFailsClosed(t *testing.T) {
	ps, sup, f := orderScenario(t, "unkeyed", "HandleOrder", 2)
	ps.publish(t, "orders", map[string]string{"source": "batch"}, order("PO-6"))
	eventually(t, 30*time.Second, "three refusals", func() bool { return f.statusCounts()[http.StatusBadRequest] >= 3 })
	if distinct, calls := sup.orders(); distinct != 0 || calls != 0 {
		t.Fatalf("an order without a key reached the supplier (%d calls)", calls)
	}
	if st := f.statusCounts(); st[http.StatusOK] != 0 {
		t.Fatalf("the unkeyed message was acked: %v", st)
	}
}

func TestMutexSerializesStatusUpdatesNoneLost(t *testing.T) {
	ps, sup := newPubSub(t, "mutex"), newSupplier(t)
	f := startFleet(t, 4, env(t, ps, sup, "HandleStatusUpdate")...)
	ps.topic(t, "status")
	ps.subscribe(t, "status-push", "status", f.lb.URL)
	const n = 20
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			ps.publish(t, "status", map[string]string{"po_id": "PO-7", "status": fmt.Sprint("s", i)}, map[string]any{})
		})
	}
	wg.Wait()
	eventually(t, 90*time.Second, "every update applied", func() bool {
		sup.mu.Lock()
		defer sup.mu.Unlock()
		return len(sup.history["PO-7"]) >= n
	})
	f.drained(t, 3*time.Second, 60*time.Second)
	sup.mu.Lock()
	defer sup.mu.Unlock()
	seen := map[string]int{}
	for _, s := range sup.history["PO-7"] {
		seen[s]++
	}
	if len(seen) != n || len(sup.history["PO-7"]) != n {
		t.Fatalf("history %v: want each of the %d updates exactly once", sup.history["PO-7"], n)
	}
	if sup.overlaps != 0 {
		t.Fatalf("%d read-modify-writes of one order interleaved", sup.overlaps)
	}
	t.Logf("%d updates applied one at a time; %d deliveries (statuses %v)", n, f.deliveries.Load(), f.statusCounts())
}

// The plain net/http Cloud Run service (PushHandler, no functions
// framework) behind a push subscription on its /orders path.
func TestCloudRunServiceExampleProcessesOnce(t *testing.T) {
	ps, sup := newPubSub(t, "service"), newSupplier(t)
	f := startFleetOf(t, serviceBin, 2, env(t, ps, sup, "")...)
	ps.topic(t, "orders")
	// The push endpoint is the service's /orders path.
	ps.do(t, http.MethodPut, "/subscriptions/orders-svc", map[string]any{
		"topic":      "projects/" + ps.project + "/topics/orders",
		"pushConfig": map[string]any{"pushEndpoint": f.lb.URL + "/orders"},
	}, nil)
	for range 2 {
		ps.publish(t, "orders", map[string]string{"po_id": "PO-8"}, order("PO-8"))
	}
	eventually(t, 30*time.Second, "both acked", func() bool { return f.statusCounts()[http.StatusNoContent] == 2 })
	f.drained(t, 3*time.Second, 30*time.Second)
	if n := sup.callsFor("orders:PO-8"); n != 1 {
		t.Fatalf("the supplier got %d calls, want 1 (statuses %v)", n, f.statusCounts())
	}
}
