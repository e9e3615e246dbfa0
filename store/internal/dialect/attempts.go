package dialect

import (
	"errors"
	"fmt"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// The errors that end an operation's retries once a lost reply leaves its
// outcome unknown. The backends wrap them, and never send such an
// attempt again.
var (
	// ErrUnknownOutcome ends a Claim's retries: an earlier attempt's
	// reply was lost, and the record no longer says whether that attempt
	// had won.
	ErrUnknownOutcome = errors.New("an earlier attempt's reply was lost and the record has moved on since: whether it won cannot be told")
	// ErrCompleteUnknown ends a Complete's retries: an earlier attempt's
	// reply was lost, and the record no longer says whether that attempt
	// completed it (it may have, and the record moved on after its ttl).
	ErrCompleteUnknown = errors.New("an earlier attempt's reply was lost and the record has moved on since: whether it completed cannot be told")
)

// MaxRounds bounds how often a Claim attempt looks again after losing a
// race.
const MaxRounds = 32

// Claim runs one claim's attempts: retry (the backend's policy) runs
// attempts, each of which calls round again, up to MaxRounds times,
// while it fails with race (the record changed between a read and a
// write). landed reports whether a failed attempt's write may have
// landed unseen (its reply lost); from the first such attempt on, only
// finding the claim's own token tells, so a later attempt that finds the
// key held or done by someone else ends the retries with an error
// wrapping ErrUnknownOutcome and the lost attempt's error, never
// HeldByOther or AlreadyDone.
func Claim(retry func(op func() error) error, round func() (store.Result, error), race error, landed func(error) bool) (store.Result, error) {
	var res store.Result
	var lost error
	err := retry(func() error {
		for range MaxRounds {
			var err error
			res, err = round()
			switch {
			case errors.Is(err, race):
				continue
			case err != nil:
				if lost == nil && landed(err) {
					lost = err
				}
				return err
			case lost != nil && res.Outcome != store.Won:
				return fmt.Errorf("%w (a retry found the key %v, until %v): %w",
					ErrUnknownOutcome, res.Outcome, res.Until.UTC().Format(time.RFC3339Nano), lost)
			}
			return nil
		}
		return fmt.Errorf("still contended after %d rounds", MaxRounds)
	})
	return res, err
}

// Complete runs one completion's attempts: retry runs attempt, which
// reports whether it moved the record to Done. From the first attempt
// whose write may have landed unseen (landed), a later attempt that finds
// nothing to complete cannot tell "stale" from "completed, then the ttl
// ended and someone reclaimed it": it ends the retries with an error
// wrapping ErrCompleteUnknown and the lost attempt's error, never false
// (which would call work that completed fenced out).
func Complete(retry func(op func() error) error, attempt func() (bool, error), landed func(error) bool) (bool, error) {
	var done bool
	var lost error
	err := retry(func() error {
		var err error
		done, err = attempt()
		switch {
		case err != nil:
			if lost == nil && landed(err) {
				lost = err
			}
		case !done && lost != nil:
			err = fmt.Errorf("%w: %w", ErrCompleteUnknown, lost)
		}
		return err
	})
	return done, err
}
