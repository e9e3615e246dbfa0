package redislock_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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

func prefix() string { return fmt.Sprintf("test:%016x:", rand.Uint64()) }

func newBackend(t testing.TB, c redis.Scripter, opts ...redislock.Option) *redislock.Backend {
	t.Helper()
	b, err := redislock.New(c, append([]redislock.Option{redislock.WithPrefix(prefix())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return b
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

// harness is the contract suite's factory: per case, a client and its
// fault path from connect, and a backend with a prefix of its own, a short
// ttl, and waits on the server's clock (this machine's).
func harness(connect func(t *testing.T) (redis.Scripter, storetest.Faults)) func(t *testing.T) storetest.Harness {
	return func(t *testing.T) storetest.Harness {
		const ttl = 2 * time.Second
		c, faults := connect(t)
		return storetest.Harness{
			Backend: newBackend(t, c, redislock.WithTTL(ttl)),
			TTL:     ttl,
			Step:    100 * time.Millisecond,
			Faults:  faults,
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
	if _, err := redislock.New(c, redislock.WithClaimRetries(-1)); err == nil {
		t.Error("negative retries accepted")
	}
	b, err := redislock.New(c)
	if err != nil || b.TTL() != store.DefaultTTL || !strings.Contains(b.String(), `"idempotency:"`) {
		t.Fatalf("defaults: %v %v %v", b, err, b.TTL())
	}
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

// Every instant the backend reports is on the server's clock, and expiry
// is judged against what the record stores, by the server: a client's own
// clock never enters the decision.
func TestExpiryIsJudgedByTheServerClock(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx := t.Context()

	before := serverNow(t, c)
	r, err := b.Claim(ctx, "k", 30*time.Second)
	after := serverNow(t, c)
	if err != nil || r.Outcome != store.Won {
		t.Fatalf("claim: %v %v", r.Outcome, err)
	}
	lo, hi := before.Add(30*time.Second).Truncate(time.Millisecond), after.Add(30*time.Second)
	if r.Claim.LeaseExpiry.Before(lo) || r.Claim.LeaseExpiry.After(hi) {
		t.Fatalf("lease expiry %v outside the server's [%v, %v] + lease", r.Claim.LeaseExpiry, lo, hi)
	}

	// Move the stored lease expiry to one millisecond before the server's
	// now: the very next claim reclaims, whatever the client believes.
	rawKey := prefixOf(b) + "k"
	if err := c.HSet(ctx, rawKey, "l", serverNow(t, c).UnixMilli()-1).Err(); err != nil {
		t.Fatal(err)
	}
	r2, err := b.Claim(ctx, "k", 30*time.Second)
	if err != nil || r2.Outcome != store.Won || r2.Claim.Fence != 2 {
		t.Fatalf("claim after the server-judged lapse: %v fence %d %v", r2.Outcome, r2.Claim.Fence, err)
	}
	// And a lease ten seconds ahead on the server's clock is live.
	if err := c.HSet(ctx, rawKey, "l", serverNow(t, c).UnixMilli()+10_000).Err(); err != nil {
		t.Fatal(err)
	}
	if r3, err := b.Claim(ctx, "k", time.Second); err != nil || r3.Outcome != store.HeldByOther {
		t.Fatalf("claim within the server-judged lease: %v %v", r3.Outcome, err)
	}
}

func prefixOf(b *redislock.Backend) string {
	s := b.String()
	i := strings.Index(s, `"`)
	j := strings.Index(s[i+1:], `"`)
	return s[i+1 : i+1+j]
}

// The record lives exactly as long as the contract needs: a claimed one
// until lease + ttl, a done one until completion + ttl.
func TestRedisReapsRecordsAtExpiresAt(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c, redislock.WithTTL(time.Hour))
	ctx := t.Context()
	raw := prefixOf(b) + "k"
	pttl := func() time.Duration {
		d, err := c.PTTL(ctx, raw).Result()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	near := func(got, want time.Duration) bool { return got <= want && got > want-5*time.Second }

	r, _ := b.Claim(ctx, "k", 15*time.Minute)
	if got := pttl(); !near(got, 75*time.Minute) {
		t.Fatalf("claimed record PTTL %v, want lease + ttl = 75m", got)
	}
	b.Release(ctx, r.Claim)
	if got := pttl(); !near(got, time.Hour) {
		t.Fatalf("released record PTTL %v, want ttl = 1h", got)
	}
	r, _ = b.Claim(ctx, "k", 15*time.Minute)
	b.Complete(ctx, r.Claim)
	if got := pttl(); !near(got, time.Hour) {
		t.Fatalf("done record PTTL %v, want ttl = 1h", got)
	}
	f, _ := c.HGet(ctx, raw, "f").Int64()
	if f != 3 {
		t.Fatalf("stored fence %d, want 3 (claim, release, reclaim)", f)
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
	f, _ := c.HGet(ctx, prefixOf(b)+"order", "f").Int64()
	s, _ := c.HGet(ctx, prefixOf(b)+"order", "s").Result()
	if f != 2 || s != "d" || sends != 2 {
		t.Fatalf("fence %d state %q sends %d; want the reclaimer's done record at fence 2", f, s, sends)
	}
	if err := idempotency.Lock(ctx, b, "order", func(context.Context) error { return nil }); !errors.Is(err, idempotency.ErrDuplicate) {
		t.Fatalf("after both: %v, want ErrDuplicate", err)
	}
}

func TestLostClaimReplyIsReaffirmedNotLockedOut(t *testing.T) {
	addr := testsvc.Redis(t)
	for _, tc := range []struct {
		name        string
		clientRetry int // go-redis MaxRetries; -1 disables its own retries
		ours        int
	}{
		{"backend retries", -1, 2},
		// go-redis's own retries stay off for the scripts (see
		// TestGoRedisNeverResendsAScript): the backend resends.
		{"backend retries, client MaxRetries 3", 3, 2},
	} {
		for _, path := range []string{"create", "reclaim"} {
			t.Run(tc.name+"/"+path, func(t *testing.T) {
				proxy := testsvc.NewDropProxy(t, addr)
				c := client(t, proxy.Addr(), func(o *redis.Options) { o.MaxRetries = tc.clientRetry })
				b := newBackend(t, c, redislock.WithClaimRetries(tc.ours))
				ctx := t.Context()
				wantFence := int64(1)
				if path == "reclaim" {
					// A crashed holder's record, lease lapsed.
					if r, err := b.Claim(ctx, "k", time.Millisecond); err != nil || r.Outcome != store.Won {
						t.Fatal(r, err)
					}
					time.Sleep(5 * time.Millisecond)
					wantFence = 2
				} else if _, err := b.Claim(ctx, "warm-up", time.Minute); err != nil { // load the scripts
					t.Fatal(err)
				}

				proxy.Armed.Store(true)
				r, err := b.Claim(ctx, "k", time.Minute)
				if proxy.Dropped.Load() != 1 {
					t.Fatalf("the proxy dropped %d replies, want 1", proxy.Dropped.Load())
				}
				if err != nil || r.Outcome != store.Won || r.Claim.Fence != wantFence {
					t.Fatalf("retried claim: %v fence %d err %v; want won, fence %d (re-affirmed, not bumped twice)",
						r.Outcome, r.Claim.Fence, err, wantFence)
				}
				if tok, _ := c.HGet(ctx, prefixOf(b)+"k", "t").Result(); tok != r.Claim.Token {
					t.Fatalf("stored token %q, want the claim's %q", tok, r.Claim.Token)
				}
				if other, _ := b.Claim(ctx, "k", time.Minute); other.Outcome != store.HeldByOther {
					t.Fatalf("another delivery: %v, want held by other", other.Outcome)
				}
				if ok, err := b.Complete(ctx, r.Claim); !ok || err != nil {
					t.Fatalf("complete of the re-affirmed claim: %v %v", ok, err)
				}
			})
		}
	}
}

// go-redis resends a command after a network error (MaxRetries), without
// the backend knowing that the reply it then gets is a resend's. The
// backend turns that off for its scripts: with its own resends off, a lost
// reply is an error after exactly one run of the script, whatever the
// client's MaxRetries.
func TestGoRedisNeverResendsAScript(t *testing.T) {
	srv := testsvc.StartRedis(t)
	proxy := testsvc.NewDropProxy(t, srv.Addr)
	c := client(t, proxy.Addr(), func(o *redis.Options) { o.MaxRetries = 5 })
	b := newBackend(t, c, redislock.WithClaimRetries(0))
	ctx := t.Context()
	direct := client(t, srv.Addr)
	scripts := func() int64 { return scriptRuns(t, direct) }
	r, err := b.Claim(ctx, "k", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	// Load every script, so that the reply lost is the script's, not a
	// NOSCRIPT.
	b.Extend(ctx, r.Claim, time.Minute)
	b.Release(ctx, store.Claim{Key: "k", Fence: 99})
	b.Complete(ctx, store.Claim{Key: "k", Fence: 99})
	for _, op := range []struct {
		name string
		call func() error
	}{
		{"claim", func() error { _, err := b.Claim(ctx, "k2", time.Minute); return err }},
		{"extend", func() error { _, err := b.Extend(ctx, r.Claim, time.Minute); return err }},
		{"complete", func() error { _, err := b.Complete(ctx, r.Claim); return err }},
		{"release", func() error { return b.Release(ctx, r.Claim) }},
	} {
		before := scripts()
		c.Ping(ctx) // a pooled connection, so the reply lost is the script's, not a handshake's
		proxy.Armed.Store(true)
		err := op.call()
		if ran := scripts() - before; ran != 1 {
			t.Errorf("%s: the script ran %d times, want 1 (no resend by go-redis)", op.name, ran)
		}
		if err == nil {
			t.Errorf("%s: no error after a lost reply and no resend", op.name)
		}
	}
}

func TestALostReplyWithNoRetryIsAnErrorNotHeldByOther(t *testing.T) {
	proxy := testsvc.NewDropProxy(t, testsvc.Redis(t))
	c := client(t, proxy.Addr(), func(o *redis.Options) { o.MaxRetries = -1 })
	b := newBackend(t, c, redislock.WithClaimRetries(0))
	ctx := t.Context()
	b.Claim(ctx, "warm-up", time.Minute)
	proxy.Armed.Store(true)
	r, err := b.Claim(ctx, "k", time.Minute)
	if err == nil || !strings.Contains(err.Error(), "outcome unknown") {
		t.Fatalf("claim whose reply was lost: %v %v; want an error saying the outcome is unknown", r.Outcome, err)
	}
}

func TestCancelledContextDuringClaimIsReportedAsUnknown(t *testing.T) {
	c := client(t, testsvc.Redis(t))
	b := newBackend(t, c)
	ctx, cancel := context.WithTimeout(t.Context(), time.Nanosecond)
	defer cancel()
	<-ctx.Done()
	_, err := b.Claim(ctx, "k", time.Minute)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want DeadlineExceeded", err)
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

// The contract on a three-master Redis Cluster: one key per record, so
// every script runs on the node that owns its key's slot. Each case has a
// cluster client of its own whose connections to every node go through one
// fault controller (clusterFaults).
func TestContractOnACluster(t *testing.T) {
	addrs := testsvc.StartRedisCluster(t)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { c.Close() })
	// t.Run returns once every parallel case of the suite has finished.
	t.Run("contract", func(t *testing.T) {
		storetest.Run(t, harness(func(t *testing.T) (redis.Scripter, storetest.Faults) {
			f := newClusterFaults()
			cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, Dialer: f.dial})
			t.Cleanup(func() { cc.Close(); f.CutConnections() })
			return cc, f
		}))
	})
	// The suite's keys landed on every node, not one. A -run that picks a
	// few cases writes too few keys (which may have expired) to tell.
	if f := flag.Lookup("test.run"); f != nil && strings.Contains(f.Value.String(), "/") {
		return
	}
	var mu sync.Mutex
	perNode := map[string]int64{}
	err := c.ForEachMaster(t.Context(), func(ctx context.Context, node *redis.Client) error {
		n, err := node.DBSize(ctx).Result()
		mu.Lock()
		perNode[node.Options().Addr] = n
		mu.Unlock()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for addr, n := range perNode {
		if n == 0 {
			t.Errorf("node %s holds no records (%v): the keys did not spread", addr, perNode)
		}
	}
}

// clusterFaults implements storetest.Faults for a cluster client: its
// Dialer wraps every connection the client opens, to whichever node, so
// that one switch loses the next reply from any node (exactly one, as a
// single DropProxy does for one server) and one call cuts every
// connection. The reply is read from the server, so the command ran, and
// then swallowed with its connection.
type clusterFaults struct {
	armed   atomic.Bool
	dropped atomic.Int32
	mu      sync.Mutex
	conns   map[*faultConn]struct{}
}

func newClusterFaults() *clusterFaults {
	return &clusterFaults{conns: map[*faultConn]struct{}{}}
}

func (f *clusterFaults) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	fc := &faultConn{Conn: c, f: f}
	f.mu.Lock()
	f.conns[fc] = struct{}{}
	f.mu.Unlock()
	return fc, nil
}

// LoseNextReply implements storetest.Faults.
func (f *clusterFaults) LoseNextReply() { f.armed.Store(true) }

// CutConnections implements storetest.Faults.
func (f *clusterFaults) CutConnections() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for c := range f.conns {
		c.Conn.Close()
		delete(f.conns, c)
	}
}

type faultConn struct {
	net.Conn
	f *clusterFaults
}

func (c *faultConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && c.f.armed.CompareAndSwap(true, false) {
		c.f.dropped.Add(1)
		c.Close()
		return 0, io.EOF
	}
	return n, err
}

// SyscallConn lets go-redis's pool check a pooled connection before use,
// as it does for a plain TCP connection, and drop one that was cut.
func (c *faultConn) SyscallConn() (syscall.RawConn, error) {
	sc, ok := c.Conn.(syscall.Conn)
	if !ok {
		return nil, errors.New("not a syscall.Conn")
	}
	return sc.SyscallConn()
}

func (c *faultConn) Close() error {
	c.f.mu.Lock()
	delete(c.f.conns, c)
	c.f.mu.Unlock()
	return c.Conn.Close()
}

// The cluster's fault controller loses exactly one reply, whichever node
// sends it, and the backend's resend recognises its own claim.
func TestClusterFaultsLoseOneReplyAcrossNodes(t *testing.T) {
	addrs := testsvc.StartRedisCluster(t)
	f := newClusterFaults()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, Dialer: f.dial})
	t.Cleanup(func() { cc.Close() })
	b := newBackend(t, cc)
	ctx := t.Context()
	// Keys on every node: warm each node's connection and script cache.
	keys := []string{"{a}k", "{b}k", "{c}k", "{d}k", "{e}k", "{f}k"}
	for _, k := range keys {
		if _, err := b.Claim(ctx, "warm-"+k, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	for i, k := range keys {
		f.LoseNextReply()
		r, err := b.Claim(ctx, k, time.Minute)
		if err != nil || r.Outcome != store.Won || r.Claim.Fence != 1 {
			t.Fatalf("%s: %v fence %d %v; want won with fence 1, re-affirmed by the resend", k, r.Outcome, r.Claim.Fence, err)
		}
		if got := f.dropped.Load(); got != int32(i+1) {
			t.Fatalf("%d replies lost after %d arms", got, i+1)
		}
		if other, err := b.Claim(ctx, k, time.Minute); err != nil || other.Outcome != store.HeldByOther {
			t.Fatalf("%s: another claim: %v %v", k, other.Outcome, err)
		}
	}
	f.CutConnections()
	if r, err := b.Claim(ctx, "{a}after-cut", time.Minute); err != nil || r.Outcome != store.Won {
		t.Fatalf("after a cut: %v %v", r.Outcome, err)
	}
}
