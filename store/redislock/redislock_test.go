package redislock_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

// quiet drops go-redis's own log lines (dial retries while a test has the
// server down on purpose).
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

func TestMain(m *testing.M) {
	redis.SetLogger(quiet{})
	code := m.Run()
	testsvc.StopAll()
	os.Exit(code)
}

func client(t testing.TB, addr string, opts ...func(*redis.Options)) *redis.Client {
	t.Helper()
	o := &redis.Options{Addr: addr}
	for _, f := range opts {
		f(o)
	}
	c := redis.NewClient(o)
	t.Cleanup(func() { c.Close() })
	return c
}

// oneDial has go-redis dial once per command, not five times 100ms apart,
// so that each of the backend's attempts on a dead server fails at once.
func oneDial(o *redis.Options) { o.DialerRetries = 1 }

func prefix() string { return fmt.Sprintf("test:%016x:", rand.Uint64()) }

func newBackend(t testing.TB, c redis.Scripter, opts ...redislock.Option) *redislock.Backend {
	t.Helper()
	b, err := redislock.New(c, append([]redislock.Option{redislock.WithPrefix(prefix())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// serverNow reads the server's clock.
func serverNow(t *testing.T, c *redis.Client) time.Time {
	t.Helper()
	now, err := c.Time(t.Context()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return now
}

func prefixOf(b *redislock.Backend) string {
	s := b.String()
	i := strings.Index(s, `"`)
	j := strings.Index(s[i+1:], `"`)
	return s[i+1 : i+1+j]
}

// namedOp is one of the backend's four operations, by name.
type namedOp struct {
	name string
	call func(context.Context) error
}

// ops calls each of b's operations in turn: Claim of cl.Key, then Extend,
// Complete and Release of cl.
func ops(b *redislock.Backend, cl store.Claim) []namedOp {
	return []namedOp{
		{"claim", func(ctx context.Context) error { _, err := b.Claim(ctx, cl.Key, time.Minute); return err }},
		{"extend", func(ctx context.Context) error { _, err := b.Extend(ctx, cl, time.Minute); return err }},
		{"complete", func(ctx context.Context) error { _, err := b.Complete(ctx, cl); return err }},
		{"release", func(ctx context.Context) error { return b.Release(ctx, cl) }},
	}
}

// The contract on one redis-server, each case through a DropProxy of its
// own that can lose a reply or cut the connections.
func TestContract(t *testing.T) {
	addr := testsvc.Redis(t)
	storetest.Run(t, harness(func(t *testing.T) (redis.Scripter, storetest.Faults) {
		proxy := testsvc.NewDropProxy(t, addr)
		return client(t, proxy.Addr()), proxy
	}))
}

// The operations (store.Operator) on one redis-server, each case through
// a DropProxy of its own. SCAN may report a key twice: ListMayRepeat.
func TestOps(t *testing.T) {
	addr := testsvc.Redis(t)
	storetest.RunOps(t, opsHarness(harness(func(t *testing.T) (redis.Scripter, storetest.Faults) {
		proxy := testsvc.NewDropProxy(t, addr)
		return client(t, proxy.Addr()), proxy
	})))
}

// opsHarness is h for RunOps: List may repeat a record (Redis SCAN).
func opsHarness(h func(t *testing.T) storetest.Harness) func(t *testing.T) storetest.Harness {
	return func(t *testing.T) storetest.Harness {
		hh := h(t)
		hh.ListMayRepeat = true
		return hh
	}
}

// Redis deletes a record by itself at its expires-at (PEXPIREAT), and the
// next Claim starts a fresh record at fence 1: the history check meets such
// restarts by the hundred with the harness's 2s ttl (222 in a run of
// 10,000 calls), and here it must meet some, so that the claims from before
// a deletion that carry the new record's fence with another token are
// checked to change nothing.
func TestHistoryFencesRestartAfterRedisExpires(t *testing.T) {
	addr := testsvc.Redis(t)
	h := harness(func(t *testing.T) (redis.Scripter, storetest.Faults) {
		proxy := testsvc.NewDropProxy(t, addr)
		return client(t, proxy.Addr()), proxy
	})(t)
	storetest.CheckHistory(t, h, storetest.HistoryOptions{Ops: 5000, MinRestarts: 20})
}

// harness is the contract suite's factory: per case, a client and its
// fault path from connect, and a backend with a prefix of its own, a short
// ttl, and waits on the server's clock (this machine's).
//
// It leaves ServerClock nil, so the cases about a server clock that jumps
// skip: Redis has no command that moves its clock, and redis-server cannot
// run under libfaketime (this machine's is built with jemalloc, which reads
// the clock while libfaketime initializes: libfaketime prints "Unexpected
// recursive calls to clock_gettime() without proper initialization" and
// the server never listens; wolfcw/libfaketime#130, open since 0.9.7).
// redislock reads no clock of the client's, and judges every lease and ttl
// by TIME inside its scripts, so there is no estimate a jump could make
// stale.
func harness(connect func(t *testing.T) (redis.Scripter, storetest.Faults)) func(t *testing.T) storetest.Harness {
	return func(t *testing.T) storetest.Harness {
		const ttl = 2 * time.Second
		c, faults := connect(t)
		return storetest.Harness{
			Backend: newBackend(t, c, redislock.WithTTL(ttl)),
			TTL:     ttl,
			Step:    100 * time.Millisecond,
			Faults:  faults,
			WithTTL: func(ttl time.Duration) store.Backend { return newBackend(t, c, redislock.WithTTL(ttl)) },
		}
	}
}

func TestNewRefusesBadConfiguration(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	if _, err := redislock.New(nil); err == nil {
		t.Error("nil client accepted")
	}
	if _, err := redislock.New(c, redislock.WithTTL(0)); !errors.Is(err, store.ErrInvalidTTL) {
		t.Errorf("ttl 0: %v", err)
	}
	if _, err := redislock.New(c, redislock.WithPrefix(strings.Repeat("p", store.MaxKeyLen+1))); err == nil {
		t.Error("oversized prefix accepted")
	}
	if _, err := redislock.New(c, redislock.WithRetries(-1)); err == nil {
		t.Error("negative retries accepted")
	}
	b, err := redislock.New(c)
	if err != nil || b.TTL() != store.DefaultTTL || !strings.Contains(b.String(), `"idempotency:"`) {
		t.Fatalf("defaults: %v %v %v", b, err, b.TTL())
	}
}

func TestZombieIsFencedOutWhenLeasePlusTTLOutlivesTheHolder(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(2*time.Second))
	ctx := t.Context()
	sends := 0
	l := slogDiscard()
	// The holder stalls past its 100ms lease; a redelivery takes over.
	err := idempotency.Lock(ctx, b, "order", func(ctx context.Context) error {
		sends++
		time.Sleep(300 * time.Millisecond)
		if err := idempotency.Lock(ctx, b, "order", func(context.Context) error { sends++; return nil }); err != nil {
			t.Errorf("reclaimer: %v", err)
		}
		return nil
	}, idempotency.WithLease(100*time.Millisecond), idempotency.WithLogger(l))
	if err != nil {
		t.Fatal(err)
	}
	// The zombie's late completion did not overwrite the reclaimer's.
	rec := readRecord(t, c, prefixOf(b)+"order")
	f, s := rec.Fence, rec.State
	if f != 2 || s != "d" || sends != 2 {
		t.Fatalf("fence %d state %q sends %d; want the reclaimer's done record at fence 2", f, s, sends)
	}
	if err := idempotency.Lock(ctx, b, "order", func(context.Context) error { return nil }); !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("after both: %v, want ErrDuplicate", err)
	}
}

func TestRedisRestartedMidTest(t *testing.T) {
	srv := testsvc.StartRedis(t, "--appendonly", "yes", "--appendfsync", "always")
	c := client(t, srv.Addr, func(o *redis.Options) {
		o.DialTimeout = 200 * time.Millisecond
		o.MaxRetries = 1
	})
	b := newBackend(t, c)
	ctx := t.Context()
	r, err := b.Claim(ctx, "k", time.Hour)
	if err != nil || r.Outcome != store.Won {
		t.Fatal(r, err)
	}

	srv.Kill()
	down, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	for _, op := range []func() error{
		func() error { _, err := b.Claim(down, "k2", time.Minute); return err },
		func() error { _, err := b.Complete(down, r.Claim); return err },
		func() error { return b.Release(down, r.Claim) },
	} {
		err := op()
		if err == nil {
			t.Fatal("an operation succeeded with the server down")
		}
		var opErr *net.OpError
		if !errors.As(err, &opErr) && !errors.Is(err, io.EOF) && !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("error %v does not wrap the network error", err)
		}
	}

	if err := srv.Restart(testsvc.RedisReady); err != nil {
		t.Fatal(err)
	}
	// The claim survived the restart (AOF, fsync always): still held, and
	// its holder can complete it.
	if other, err := b.Claim(ctx, "k", time.Minute); err != nil || other.Outcome != store.HeldByOther {
		t.Fatalf("after restart: %v %v, want held by other", other.Outcome, err)
	}
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("complete after restart: %v %v", ok, err)
	}
	if again, _ := b.Claim(ctx, "k", time.Minute); again.Outcome != store.AlreadyDone {
		t.Fatalf("after complete: %v", again.Outcome)
	}
}

func TestKeysAreStoredVerbatimUnderThePrefix(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := t.Context()
	for _, k := range []string{"{orders}:PO-1", "{orders}:PO-2", "a b\r\n*1\r\n$4\r\nPING", "\xff\xfe\x01", "ключ"} {
		if r, err := b.Claim(ctx, k, time.Minute); err != nil || r.Outcome != store.Won {
			t.Fatalf("%q: %v %v", k, r.Outcome, err)
		}
		if n, _ := c.Exists(ctx, prefixOf(b)+k).Result(); n != 1 {
			t.Fatalf("%q is not stored verbatim under the prefix", k)
		}
	}
}

func slogDiscard() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// WithHeartbeat keeps a claim alive on the server's clock while the work
// runs more than twice as long as its lease.
func TestHeartbeatHoldsTheKeyPastItsLease(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := t.Context()
	err := idempotency.Lock(ctx, b, "long", func(ctx context.Context) error {
		deadline := time.Now().Add(2500 * time.Millisecond) // lease 1s
		for time.Now().Before(deadline) {
			if r, err := b.Claim(ctx, "long", time.Minute); err != nil || r.Outcome != store.HeldByOther {
				t.Errorf("another delivery during the work: %v %v, want held by other", r.Outcome, err)
				return nil
			}
			time.Sleep(50 * time.Millisecond)
		}
		return nil
	}, idempotency.WithLease(time.Second), idempotency.WithHeartbeat(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if r, _ := b.Claim(ctx, "long", time.Minute); r.Outcome != store.AlreadyDone {
		t.Fatalf("after the work: %v, want already done (fence kept, completed)", r.Outcome)
	}
}

// The hazard of the resend tests in retry_test.go without any lost reply:
// a holder that outlives lease + ttl (a misconfiguration, but possible)
// finds its record reaped and created afresh at fence 1 by another caller. Its fence matches; its
// claim is not that record's, and it can change nothing.
func TestAHolderOutlivingItsRecordCannotTouchTheNextOne(t *testing.T) {
	const ttl = 100 * time.Millisecond
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(ttl))
	ctx := t.Context()
	for _, op := range []string{"complete", "release", "extend"} {
		t.Run(op, func(t *testing.T) {
			k := "k-" + op
			old, err := b.Claim(ctx, k, 10*time.Millisecond)
			if err != nil || old.Outcome != store.Won {
				t.Fatal(old.Outcome, err)
			}
			time.Sleep(10*time.Millisecond + ttl + 100*time.Millisecond)
			next, err := b.Claim(ctx, k, time.Minute)
			if err != nil || next.Outcome != store.Won || next.Claim.Fence != 1 {
				t.Fatalf("next: %v fence %d %v; want won, fence 1 (a fresh record)", next.Outcome, next.Claim.Fence, err)
			}
			switch op {
			case "complete":
				if ok, err := b.Complete(ctx, old.Claim); ok || err != nil {
					t.Fatalf("the old holder's complete: %v %v; want false", ok, err)
				}
			case "release":
				if err := b.Release(ctx, old.Claim); err != nil {
					t.Fatal(err)
				}
			case "extend":
				if _, err := b.Extend(ctx, old.Claim, time.Hour); !errors.Is(err, store.ErrLost) {
					t.Fatalf("the old holder's extend: %v; want ErrLost", err)
				}
				l := readRecord(t, c, prefixOf(b)+k).At
				if !time.UnixMilli(l).Equal(next.Claim.LeaseExpiry) {
					t.Fatalf("the next holder's lease moved to %v", time.UnixMilli(l))
				}
			}
			if got, _ := b.Claim(ctx, k, time.Minute); got.Outcome != store.HeldByOther {
				t.Fatalf("a third caller: %v; want held by other", got.Outcome)
			}
			if ok, err := b.Complete(ctx, next.Claim); !ok || err != nil {
				t.Fatalf("the next holder's complete: %v %v", ok, err)
			}
		})
	}
}

// stored is a record as Redis keeps it, in either format.
type stored struct {
	State       string // "c" or "d"
	Fence       int64
	At          int64 // ms: the lease expiry (claimed) or the expires-at (done: the key's expiry)
	Token       string
	Fingerprint string
}

// readRecord reads the record at raw: the string of the current format or
// a hash of the earlier one. It fails the test when there is none.
func readRecord(t testing.TB, c *redis.Client, raw string) stored {
	t.Helper()
	ctx := context.Background()
	typ, err := c.Type(ctx, raw).Result()
	if err != nil {
		t.Fatal(err)
	}
	switch typ {
	case "hash":
		h, err := c.HGetAll(ctx, raw).Result()
		if err != nil {
			t.Fatal(err)
		}
		r := stored{State: h["s"], Token: h["t"]}
		fmt.Sscan(h["f"], &r.Fence)
		at := h["l"]
		if r.State == "d" {
			at = h["e"]
		}
		fmt.Sscan(at, &r.At)
		return r
	case "string":
		v, err := c.Get(ctx, raw).Result()
		if err != nil {
			t.Fatal(err)
		}
		m := recordFormat.FindStringSubmatch(v)
		if m == nil {
			t.Fatalf("the value at %s, %q, is not a record", raw, v)
		}
		r := stored{State: m[1], Token: m[4], Fingerprint: m[5]}
		fmt.Sscan(m[2], &r.Fence)
		fmt.Sscan(m[3], &r.At)
		if r.State == "d" { // its expires-at is the key's expiry
			if m[3] != "" {
				t.Fatalf("the done record at %s stores an instant: %q", raw, v)
			}
			if r.At, err = c.Do(ctx, "PEXPIRETIME", raw).Int64(); err != nil {
				t.Fatal(err)
			}
		}
		return r
	}
	t.Fatalf("no record at %s (type %s)", raw, typ)
	return stored{}
}

// recordFormat is record.lua's format: state, fence, lease expiry (claimed
// only), token and an optional fingerprint (done only).
var recordFormat = regexp.MustCompile(`(?s)^([cd])([0-9]+),([0-9]*),([^,]*)(?:,(.*))?$`)

// Complete settles a record that is exactly the claim it holds without
// decoding it, and every other record by its fence and token: a claim
// whose lease expiry is not the stored one (a Claim value built or moved
// by the caller) completes all the same, with its fingerprint, and one
// whose token is another's completes nothing.
func TestCompleteDecidesByFenceAndTokenNotByTheWholeValue(t *testing.T) {
	_, b, r := wonK(t)
	ctx := t.Context()
	other := r.Claim
	other.Token = "0123456789abcdef0123456789abcdef"
	if ok, err := b.Complete(ctx, other); ok || err != nil {
		t.Fatalf("complete with another token: %v %v; want false, nil", ok, err)
	}
	moved := r.Claim
	moved.LeaseExpiry = moved.LeaseExpiry.Add(time.Hour)
	if ok, err := b.CompleteFingerprint(ctx, moved, "fp,with,commas"); !ok || err != nil {
		t.Fatalf("complete with a lease expiry that is not the stored one: %v %v; want true, nil", ok, err)
	}
	r2, err := b.Claim(ctx, "k", time.Minute)
	if err != nil || r2.Outcome != store.AlreadyDone || r2.Fingerprint != "fp,with,commas" {
		t.Fatalf("claim after complete: %+v %v; want AlreadyDone with the fingerprint", r2, err)
	}
	if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
		t.Fatalf("complete again: %v %v; want true, nil", ok, err)
	}
}
