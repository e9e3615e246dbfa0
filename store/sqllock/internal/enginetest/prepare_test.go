package enginetest

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Issue 9: the backend prepared its statements while holding one mutex, so
// one slow PREPARE blocked every caller, whatever their ctx said. A caller
// waiting for a statement that another caller is preparing must give up
// when its own ctx ends, and a caller of another statement must not wait at
// all.
func TestSlowPrepareBlocksNoOtherCaller(t *testing.T) {
	// How long a call that should return at once may take on a loaded
	// machine before the test calls it stuck.
	const stuck = 10 * time.Second
	eachEngine(t, engines, func(t *testing.T, e engine) {
		c := &counter{}
		_, b := e.fresh(t, c)
		ctx := t.Context()

		// The next prepare (the first caller's Claim statement) hangs
		// until release is closed or its ctx ends.
		entered, release := make(chan struct{}), make(chan struct{})
		var armed atomic.Bool
		armed.Store(true)
		hook := func(ctx context.Context, q string) error {
			if !armed.CompareAndSwap(true, false) {
				return nil
			}
			close(entered)
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		c.onPrepare.Store(&hook)
		type answer struct {
			r   store.Result
			err error
		}
		first := make(chan answer, 1)
		go func() {
			r, err := b.Claim(ctx, "first", time.Minute)
			first <- answer{r, err}
		}()
		<-entered

		// Same statement, short ctx: returns when its ctx ends.
		second := make(chan answer, 1)
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		go func() {
			r, err := b.Claim(short, "second", time.Minute)
			second <- answer{r, err}
		}()
		select {
		case a := <-second:
			if !errors.Is(a.err, context.DeadlineExceeded) {
				t.Errorf("a claim with a 50ms ctx behind a hanging prepare: %v %v, want context.DeadlineExceeded", a.r.Outcome, a.err)
			}
		case <-time.After(stuck):
			t.Errorf("a claim with a 50ms ctx was still waiting for another caller's prepare after %v", stuck)
		}

		// Another statement: not held up at all.
		ghost := store.Claim{Key: "ghost", Fence: 1, Token: "ghost"}
		third := make(chan error, 1)
		go func() {
			ok, err := b.Complete(ctx, ghost)
			if err == nil && ok {
				err = errors.New("completed a record that does not exist")
			}
			third <- err
		}()
		select {
		case err := <-third:
			if err != nil {
				t.Errorf("complete during another statement's prepare: %v", err)
			}
		case <-time.After(stuck):
			t.Errorf("a complete was still waiting for another statement's prepare after %v", stuck)
		}

		close(release)
		if a := <-first; a.err != nil || a.r.Outcome != store.Won {
			t.Fatalf("the claim whose prepare hung: %v %v", a.r.Outcome, a.err)
		}
		if r, err := b.Claim(ctx, "second", time.Minute); err != nil || r.Outcome != store.Won {
			t.Fatalf("claim after the prepare finished: %v %v", r.Outcome, err)
		}
	})
}

// A prepare that fails (here: its caller's ctx ends while it hangs) leaves
// nothing behind: the next caller prepares the statement itself.
func TestFailedPrepareIsRetriedByTheNextCaller(t *testing.T) {
	eachEngine(t, engines, func(t *testing.T, e engine) {
		c := &counter{}
		_, b := e.fresh(t, c)
		ctx := t.Context()
		var armed atomic.Bool
		armed.Store(true)
		hook := func(ctx context.Context, q string) error {
			if armed.CompareAndSwap(true, false) {
				<-ctx.Done()
				return ctx.Err()
			}
			return nil
		}
		c.onPrepare.Store(&hook)
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		if _, err := b.Claim(short, "k", time.Minute); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("claim whose prepare outlived its ctx: %v, want context.DeadlineExceeded", err)
		}
		if r, err := b.Claim(ctx, "k", time.Minute); err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
			t.Fatalf("the next claim: %v fence %d %v, want won with fence 1", r.Outcome, r.Claim.Fence, err)
		}
	})
}
