package firestorelock

// KeyOf exposes keyOf, the inverse of Name, to the tests.
var KeyOf = keyOf

// The constructors' errors, for errors.Is in the tests.
var (
	ErrNilConn       = errNilConn
	ErrNoProject     = errNoProject
	ErrClientOptions = errClientOptions
)
