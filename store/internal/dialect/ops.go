package dialect

import "github.com/gcp-pubsub-idempotency/idempotency/store"

// Conditional runs one attempt of an operator's conditional write
// (ForceRelease, Forget) on the record r describes: read reads the key's
// row; unless it is still r (same fence, a token of r's version) in state
// want, Conditional writes nothing and reports false; otherwise write
// runs one statement conditioned on the row it read (its key, fence and
// token), and Conditional reports whether that statement changed exactly
// one row. A record that changed between the read and the write is left
// alone, and the attempt reports false.
func Conditional(read func() (Row, bool, error), r store.Record, want store.State, write func(cur Row) (int64, error)) (bool, error) {
	cur, found, err := read()
	if err != nil || !found {
		return false, err
	}
	if store.State(cur.State) != want || cur.Fence != r.Fence || store.VersionOf(cur.Token) != r.Version {
		return false, nil
	}
	n, err := write(cur)
	return err == nil && n == 1, err
}
