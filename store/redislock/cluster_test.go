package redislock_test

import (
	"context"
	"errors"
	"flag"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/storetest"
)

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

// The operations (store.Operator) on a three-master Redis Cluster: List
// scans each master in turn.
func TestOpsOnACluster(t *testing.T) {
	addrs := testsvc.StartRedisCluster(t)
	storetest.RunOps(t, opsHarness(harness(func(t *testing.T) (redis.Scripter, storetest.Faults) {
		f := newClusterFaults()
		cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, Dialer: f.dial})
		t.Cleanup(func() { cc.Close(); f.CutConnections() })
		return cc, f
	})))
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
