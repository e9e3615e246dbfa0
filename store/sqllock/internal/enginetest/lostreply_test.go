package enginetest

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// Issue 9: a Claim whose first attempt won but lost its reply, and whose
// retry came after that win's lease had lapsed and another caller had taken
// (or taken and completed) the key, answered HeldByOther or AlreadyDone: a
// claim it may have won reported as not won. After a lost reply a retry
// may answer Won only on finding its own token (or winning afresh);
// otherwise it must return an error that wraps the driver's.
//
// The retry is held back at its new connection (the lost reply cut the
// old one) until the other caller has moved the key on.
func TestRetryAfterALostReplyThatOutlivedItsLease(t *testing.T) {
	const lease = 300 * time.Millisecond
	for _, e := range networked {
		for _, then := range []string{"held", "done", "released", "untouched"} {
			t.Run(e.name+"/"+then, func(t *testing.T) {
				dsn := e.dsn(t)
				host := serverAddr(e, dsn)
				proxy := testsvc.NewDropProxy(t, host)
				c := &counter{}
				db := e.open(t, strings.Replace(dsn, host, proxy.Addr(), 1), c)
				db.SetMaxOpenConns(1)
				b := e.backend(t, db, sqllock.WithRetries(3))
				other, err := sqllock.New(e.open(t, dsn, nil), e.dialect, sqllock.WithTable(tableOf(b)))
				if err != nil {
					t.Fatal(err)
				}
				ctx := t.Context()
				if _, err := b.Claim(ctx, "warm-up", time.Minute); err != nil {
					t.Fatal(err)
				}

				entered, release := make(chan struct{}), make(chan struct{})
				var armed atomic.Bool
				armed.Store(true)
				hold := func(ctx context.Context) error {
					if armed.CompareAndSwap(true, false) {
						close(entered)
						<-release
					}
					return nil
				}
				c.onConnect.Store(&hold)
				type answer struct {
					r   store.Result
					err error
				}
				got := make(chan answer, 1)
				proxy.LoseNextReply()
				go func() {
					r, err := b.Claim(ctx, "k", lease)
					got <- answer{r, err}
				}()
				<-entered // the first attempt's reply is lost; the retry waits to connect
				if proxy.Dropped.Load() != 1 {
					t.Fatalf("dropped %d replies, want 1", proxy.Dropped.Load())
				}
				time.Sleep(lease + 100*time.Millisecond) // the lost claim's lease lapses
				var want int64 = 1                       // untouched: its own claim
				switch then {
				case "held", "done", "released":
					r, err := other.Claim(ctx, "k", time.Minute)
					if err != nil || r.Outcome != store.Won || r.Claim.Fence != 2 {
						t.Fatalf("the other caller: %v fence %d %v; want won with fence 2 (the lost claim had won fence 1)", r.Outcome, r.Claim.Fence, err)
					}
					switch then {
					case "done":
						if ok, err := other.Complete(ctx, r.Claim); !ok || err != nil {
							t.Fatal(ok, err)
						}
					case "released":
						if err := other.Release(ctx, r.Claim); err != nil {
							t.Fatal(err)
						}
						want = 4 // a fresh win over the released fence 3
					}
				}
				close(release)
				a := <-got
				t.Logf("the retried claim: %v fence %d, %v", a.r.Outcome, a.r.Claim.Fence, a.err)
				if then == "held" || then == "done" {
					if a.err == nil {
						t.Fatalf("a claim whose lost first attempt had won answered %v after the key moved on; want an error", a.r.Outcome)
					}
					var ne net.Error
					if !errors.Is(a.err, mysql.ErrInvalidConn) && !errors.Is(a.err, io.ErrUnexpectedEOF) && !errors.Is(a.err, io.EOF) && !errors.As(a.err, &ne) {
						t.Errorf("the error does not wrap the driver's error of the lost reply: %v", a.err)
					}
					return
				}
				// Nobody holds the key: the retry finds its own claim (the same
				// fence; its lease is the one the lost attempt took, whether
				// or not it has lapsed since), or wins afresh.
				if a.err != nil || a.r.Outcome != store.Won || a.r.Claim.Fence != want {
					t.Fatalf("the retried claim: %v fence %d %v; want won with fence %d", a.r.Outcome, a.r.Claim.Fence, a.err, want)
				}
				if ok, err := b.Complete(ctx, a.r.Claim); !ok || err != nil {
					t.Fatalf("complete of the retried claim: %v %v", ok, err)
				}
			})
		}
	}
}
