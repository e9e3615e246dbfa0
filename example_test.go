package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

func ExampleLock() {
	backend := fake.New() // in production: a Datastore, Redis or SQL backend
	ctx := context.Background()

	for delivery := 1; delivery <= 2; delivery++ {
		err := idempotency.Lock(ctx, backend, "orders:PO-1001", func(ctx context.Context) error {
			fmt.Println("sending PO-1001 to the supplier")
			return nil
		})
		switch {
		case err == nil:
			fmt.Printf("delivery %d: done, ack\n", delivery)
		case errors.Is(err, idempotency.ErrDuplicate):
			fmt.Printf("delivery %d: duplicate, ack\n", delivery)
		case errors.Is(err, idempotency.ErrInProgress):
			fmt.Printf("delivery %d: busy elsewhere, nack\n", delivery)
		default:
			fmt.Printf("delivery %d: failed, nack: %v\n", delivery, err)
		}
	}
	// Output:
	// sending PO-1001 to the supplier
	// delivery 1: done, ack
	// delivery 2: duplicate, ack
}

func ExampleMutex() {
	backend := fake.New()
	ctx := context.Background()
	for _, status := range []string{"confirmed", "shipped", "delivered"} {
		// Each update for the order runs; none overlaps another.
		err := idempotency.Mutex(ctx, backend, "po:PO-1001", func(ctx context.Context) error {
			fmt.Println("PO-1001 ->", status)
			return nil
		})
		if err != nil {
			fmt.Println("nack:", err)
		}
	}
	// Output:
	// PO-1001 -> confirmed
	// PO-1001 -> shipped
	// PO-1001 -> delivered
}

func ExampleIdempotent() {
	backend := fake.New()
	sends := 0
	handleOrder := func(ctx context.Context, e cloudevents.Event) error {
		sends++
		return nil
	}
	// In a function package: functions.CloudEvent("HandleOrder", fn)
	fn := idempotency.Idempotent(backend)(handleOrder)

	e := cloudevents.NewEvent()
	e.SetID("11223344556677")
	e.SetSource("//pubsub.googleapis.com/projects/my-project/topics/orders")
	e.SetType(idempotency.PubSubEventType)
	_ = e.SetData(cloudevents.ApplicationJSON, map[string]any{
		"message": map[string]any{"messageId": "11223344556677", "data": "e30="},
	})

	fmt.Println("first delivery:", fn(context.Background(), e))
	fmt.Println("redelivery:", fn(context.Background(), e))
	fmt.Println("sends:", sends)
	// Output:
	// first delivery: <nil>
	// redelivery: <nil>
	// sends: 1
}

func ExampleWithKey() {
	// Key by the order, not the message: a producer that publishes the
	// same order twice (two messageIds) still sends it once.
	backend := fake.New()
	fn := idempotency.Idempotent(backend,
		idempotency.WithKey(idempotency.Attribute("po_id")),
		idempotency.WithKeyPrefix("orders:"),
	)(func(ctx context.Context, e cloudevents.Event) error {
		fmt.Println("sending order from message", e.ID())
		return nil
	})
	for _, id := range []string{"1001", "1002"} {
		e := cloudevents.NewEvent()
		e.SetID(id)
		e.SetSource("//pubsub.googleapis.com/projects/my-project/topics/orders")
		e.SetType(idempotency.PubSubEventType)
		_ = e.SetData(cloudevents.ApplicationJSON, map[string]any{
			"message": map[string]any{"messageId": id, "attributes": map[string]string{"po_id": "PO-7"}},
		})
		_ = fn(context.Background(), e)
	}
	rec, _ := backend.Record("orders:PO-7")
	fmt.Println("record:", rec.State)
	// Output:
	// sending order from message 1001
	// record: done
}

func ExampleClaimFrom() {
	backend := fake.New()
	_ = idempotency.Lock(context.Background(), backend, "orders:PO-9", func(ctx context.Context) error {
		c, _ := idempotency.ClaimFrom(ctx)
		// Hand the fence to a sink that refuses writes from older holders.
		fmt.Printf("writing %s with fence %d\n", c.Key, c.Fence)
		return nil
	})
	// Output:
	// writing orders:PO-9 with fence 1
}

func ExampleInProgressError() {
	clock := fake.NewClock(time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC))
	backend := fake.New(fake.WithClock(clock.Now))
	ctx := context.Background()
	_, _ = backend.Claim(ctx, "po:PO-3", 15*time.Minute) // another instance holds it

	err := idempotency.Mutex(ctx, backend, "po:PO-3", func(context.Context) error { return nil })
	var busy *idempotency.InProgressError
	if errors.As(err, &busy) {
		fmt.Println("retry after", busy.Until.Format(time.Kitchen))
	}
	// Output:
	// retry after 12:15PM
}
