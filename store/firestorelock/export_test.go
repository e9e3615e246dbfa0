package firestorelock

import "github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"

// KeyOf exposes keyOf, the inverse of Name, to the tests.
var KeyOf = keyOf

// The constructors' errors, for errors.Is in the tests.
var (
	ErrNilConn       = doclock.ErrNilConn
	ErrNoProject     = doclock.ErrNoProject
	ErrClientOptions = doclock.ErrClientOptions
)
