package idempotency_test

import (
	"context"
	"fmt"

	cloudevents "github.com/cloudevents/sdk-go/v2"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
)

func ExampleEventID() {
	backend := fake.New() // in production: a Datastore, Firestore, Spanner, Redis or SQL backend
	handleUpload := func(ctx context.Context, e cloudevents.Event) error {
		fmt.Println("thumbnailing", e.Subject())
		return nil
	}
	fn := idempotency.Idempotent(backend)(handleUpload) // DefaultKey: EventID for this event

	// What Eventarc delivers for a Cloud Storage upload, twice: the first
	// acknowledgement was lost, so the event came again.
	e := cloudevents.NewEvent()
	e.SetID("8517291945127406")
	e.SetSource("//storage.googleapis.com/projects/_/buckets/uploads")
	e.SetType("google.cloud.storage.object.v1.finalized")
	e.SetSubject("objects/cat.png")
	for range 2 {
		fmt.Println("returned", fn(context.Background(), e))
	}
	key, _ := idempotency.EventID()(e)
	fmt.Println("key:", key)
	// Output:
	// thumbnailing objects/cat.png
	// returned <nil>
	// returned <nil>
	// key: //storage.googleapis.com/projects/_/buckets/uploads|8517291945127406
}
