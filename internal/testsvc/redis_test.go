package testsvc

import "testing"

// The shared server is one per binary, and answers.
func TestRedisIsSharedAndAnswers(t *testing.T) {
	t.Parallel()
	a, b := Redis(t), Redis(t)
	if a != b {
		t.Fatalf("Redis returned %q, then %q", a, b)
	}
	if err := RedisReady(a); err != nil {
		t.Fatal(err)
	}
}

// A server of its own: Kill stops it answering, Restart brings it back on
// the same address.
func TestStartRedisKillAndRestart(t *testing.T) {
	t.Parallel()
	p := StartRedis(t)
	if p.Addr == Redis(t) {
		t.Fatal("StartRedis returned the shared server")
	}
	restart(t, p, RedisReady)
}

// restart checks that p answers ready, stops answering once killed, and
// answers on the same address after Restart.
func restart(t *testing.T, p *Process, ready func(addr string) error) {
	t.Helper()
	if err := ready(p.Addr); err != nil {
		t.Fatal(err)
	}
	p.Kill()
	if err := ready(p.Addr); err == nil {
		t.Fatalf("%s still answers on %s after Kill", p.Name, p.Addr)
	}
	addr := p.Addr
	if err := p.Restart(ready); err != nil {
		t.Fatal(err)
	}
	if p.Addr != addr {
		t.Fatalf("Restart moved %s from %s to %s", p.Name, addr, p.Addr)
	}
}

func TestStartRedisCluster(t *testing.T) {
	t.Parallel()
	addrs := StartRedisCluster(t)
	seen := map[string]bool{}
	for _, a := range addrs {
		if err := RedisReady(a); err != nil {
			t.Error(err)
		}
		seen[a] = true
	}
	if len(seen) != 3 {
		t.Fatalf("nodes %v, want three distinct", addrs)
	}
}
