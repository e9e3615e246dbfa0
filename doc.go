// Package idempotency gives Google Cloud Pub/Sub push consumers
// exactly-once processing on top of Pub/Sub's at-least-once delivery.
//
// Wrap a CloudEvent function once and its body runs at most once per key: a
// redelivery or a concurrent duplicate skips it, a failure nacks so Pub/Sub
// retries (it never vanishes), a crashed holder's key frees itself when its
// lease lapses, and a holder that was replaced cannot overwrite its
// successor's outcome.
//
//	func init() {
//		functions.CloudEvent("HandleOrder", idempotency.Idempotent(backend)(handleOrder))
//	}
//
// # Two verbs, one port
//
// [Lock] de-duplicates: the body runs at most once per key, and the key
// stays done for the backend's ttl. [Mutex] serializes: every call runs its
// body, never two at once for one key, and the key is never marked done.
// Both run over a [store.Backend], a three-method port (Claim, Complete,
// Release) with leases, fencing tokens and a ttl; package
// [github.com/gcp-pubsub-idempotency/idempotency/fake] has an in-memory one
// for tests, and the modules under store/ have Datastore, Redis and SQL
// ones. [Idempotent] wraps a CloudEvent function in Lock, keyed by the
// event ([KeyFunc]: [DefaultKey], which is [MessageID] for a Pub/Sub
// message and [EventID] for any other event, or a business key:
// [Attribute], [JSONField], [CompositeKey]).
//
// Without the functions framework, [PushHandler] serves the same guard as a
// plain [net/http.Handler] for raw push envelopes and CloudEvents, and
// answers the same statuses.
//
// # What goes on the wire
//
// Idempotent maps each outcome to what its function returns, which the
// functions framework turns into the HTTP status Pub/Sub acts on
// (PushHandler writes the same status, and 204 for an ack):
//
//	outcome                                returned            HTTP   Pub/Sub
//	handler returned nil                   nil                 200    ack
//	duplicate: key done within the ttl     nil                 200    ack (handler skipped)
//	key done with a different payload      409 result          409    nack (see WithFingerprint)
//	key held by a live lease elsewhere     503 result          503    nack, retried later
//	handler returned an error              the error           500    nack, retried
//	handler's error wraps ErrInProgress    503 result          503    nack, retried later
//	event has no key                       400 result          400    nack (fail closed)
//	data not a Pub/Sub envelope (1)        400 result          400    nack (fail closed)
//	backend failed to claim                the error           500    nack, retried
//
// (1) A Pub/Sub-typed event, or any event under a KeyFunc that reads the
// Pub/Sub envelope (MessageID, Attribute, JSONField); the default key
// reads other events' source and id only.
//
// A result wraps what the guard decided: errors.Is sees [ErrInProgress],
// [ErrNoKey] or [ErrMalformedEvent] through it. An unkeyed or malformed
// message is a 400 because Pub/Sub redelivers every nack alike (it is kept,
// never lost, until the dead-letter policy takes it) while people and
// monitoring read the status: the message is wrong, not the service.
//
// Only the guard's own outcomes ack. A handler's error is a failure even
// when it wraps [ErrDuplicate] (a nested Lock's), and it keeps a cloudevents
// HTTP result's status only when that is a 4xx or 5xx: any status that
// Pub/Sub would take as an ack becomes a 500. A key the port refuses
// (over [store.MaxKeyLen] bytes, or with a NUL byte) is a 400 unless
// [WithHashedKeys] stores it hashed. docs/bad-input.md lists what every
// hostile input gets.
//
// # Invariants to size for
//
//  1. The lease must exceed the longest run of the guarded work; otherwise a
//     redelivery may take the key over while the work still runs. Work of
//     unbounded length can renew its lease with [WithHeartbeat].
//     [WithLeaseFromDeadline] sizes it per request from the context's
//     deadline, so that a crashed holder's key frees soon after the
//     function's timeout.
//  2. Lease + ttl must exceed the longest life of a holder process (Cloud
//     Run: the request timeout, at most 60 minutes), so that a record
//     outlives every holder and fences keep rising instead of restarting.
//  3. The subscription's dead-letter max delivery attempts must exceed the
//     retries a message can spend waiting on a live lease (503 nacks count
//     as attempts too).
//
// # Where an error is swallowed, and why
//
// Three failures happen after the work already ran. Reporting them as
// failures would nack the message and run the work again, so they are
// logged at ERROR and acknowledged: Complete failing, the claim being
// fenced out because the work outran its lease and another delivery took
// the key, and the [OnDuplicate] hook failing or panicking.
package idempotency
