package store

import (
	"context"
	"errors"
)

// TxCompleter is implemented by backends whose store can also hold the
// caller's own data (a SQL database, Spanner, Datastore, Firestore), so
// that the work's writes and the Done mark commit in one transaction. Tx
// is the store's native transaction handle (*sql.Tx,
// *spanner.ReadWriteTransaction, *datastore.Transaction,
// *firestore.Transaction).
//
// With an ordinary [Backend.Complete], a process that dies between the
// work's last write and the completion leaves the key claimed, and the
// next holder runs the work again. With CompleteTx there is no such
// window: the writes and the mark land together or not at all, and a
// holder that was replaced cannot commit either.
type TxCompleter[Tx any] interface {
	// CompleteTx begins a transaction on the backend's store, calls body
	// with it, and then, in the same transaction, moves c's record from
	// Claimed to Done (storing fp as [Fingerprinter.CompleteFingerprint]
	// does; none when empty) if its fence and token still match c's, and
	// commits once. The lease is not tested, as for Complete.
	//
	// Rules, which the storetest suite checks (RunTx):
	//
	//   - It MUST validate c.Key and fp before any I/O.
	//   - It returns true, nil only when the transaction committed, with
	//     the body's writes and the Done mark.
	//   - It returns false, nil when the record is not Claimed with c's
	//     fence and token (c was replaced, released, or already
	//     completed): the transaction is rolled back, and none of the
	//     body's writes exist.
	//   - When body returns an error, it rolls back and returns an error
	//     that wraps body's error ([errors.Is] and [errors.As] find it);
	//     nothing is written.
	//   - Any other error means the transaction did not commit, so far as
	//     the backend can tell. When the reply to the commit is lost, it
	//     MUST settle the outcome before it returns (by the claim token:
	//     the record Done with c's fence and token means committed), and
	//     it MUST make sure that a commit still in flight can no longer
	//     land (for example by releasing c, which fences it out). Only
	//     when it cannot settle does it return an error wrapping
	//     [ErrCommitUnknown].
	//   - It MAY call body more than once, when the store retries the
	//     transaction (an abort, a conflict): each call gets a fresh
	//     transaction, and only the writes of the call whose transaction
	//     commits exist. Whatever body does outside the transaction
	//     (calls to other services, sends) may happen once per call.
	//   - It MUST NOT hold a lock on c's record while body runs, so that a
	//     concurrent Claim of the key still gets its prompt HeldByOther.
	//   - It honours ctx: the transaction runs under it, and a ctx that
	//     ends before the commit rolls it back.
	CompleteTx(ctx context.Context, c Claim, fp string, body func(ctx context.Context, tx Tx) error) (bool, error)
}

// TxBackend is a [Backend] that also completes claims inside the caller's
// transactions ([TxCompleter]).
type TxBackend[Tx any] interface {
	Backend
	TxCompleter[Tx]
}

// ErrCommitUnknown reports, from [TxCompleter.CompleteTx], a transaction
// whose commit reply was lost and whose outcome the backend could not
// settle: the body's writes and the Done mark may or may not exist
// (always both or neither). The caller must not treat it as success; a
// redelivery finds the key Done (a duplicate) if the commit landed, and
// otherwise claims it again once the claim is released or its lease lapses.
var ErrCommitUnknown = errors.New("store: transaction commit outcome unknown")
