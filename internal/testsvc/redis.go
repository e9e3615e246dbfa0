package testsvc

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

const redisHow = "install Debian's redis-server (apt-get install -y redis-server) or set REDIS_ADDR"

// RedisReady answers whether a Redis server on addr answers PING.
func RedisReady(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if !strings.HasPrefix(line, "+PONG") {
		return fmt.Errorf("PING answered %q", strings.TrimSpace(line))
	}
	return nil
}

// lookRedis returns the path of the named Redis program (redis-server,
// redis-cli), or skips or fails t without it.
func lookRedis(t testing.TB, name string) string {
	t.Helper()
	bin, err := exec.LookPath(name)
	if err != nil {
		Missing(t, name, redisHow)
	}
	return bin
}

// StartRedis starts a redis-server of its own for t, with extra arguments
// (for example "--appendonly", "yes"), and kills it when t ends.
func StartRedis(t testing.TB, extra ...string) *Process {
	t.Helper()
	p, err := startRedis(lookRedis(t, "redis-server"), t.TempDir(), extra)
	return own(t, p, err)
}

// startRedis starts a redis-server on a free port, without persistence
// unless extra asks for it, its files in dir.
func startRedis(bin, dir string, extra []string) (*Process, error) {
	port, addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	args := append([]string{
		"--port", fmt.Sprint(port), "--bind", "127.0.0.1", "--dir", dir,
		"--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
	}, extra...)
	return Start("redis", bin, dir, addr, args, RedisReady)
}

var sharedRedis shared

// Redis returns the address of a Redis server shared by the whole test
// binary: REDIS_ADDR when set, else one it starts. Tests sharing it must use
// keys of their own.
func Redis(t testing.TB) string {
	t.Helper()
	if addr := os.Getenv("REDIS_ADDR"); addr != "" {
		return addr
	}
	bin := lookRedis(t, "redis-server")
	return sharedRedis.get(t, "testsvc-redis-", func(dir string) (*Process, string, error) {
		p, err := startRedis(bin, dir, nil)
		if err != nil {
			return nil, "", err
		}
		return p, p.Addr, nil
	})
}

// StartRedisCluster starts a three-master Redis Cluster of its own for t
// and returns its nodes' addresses once the cluster reports ok. The nodes
// are killed when t ends.
func StartRedisCluster(t testing.TB) []string {
	t.Helper()
	bin := lookRedis(t, "redis-server")
	cli := lookRedis(t, "redis-cli")
	var addrs []string
	for range 3 {
		p, err := startRedis(bin, t.TempDir(), []string{"--cluster-enabled", "yes", "--cluster-node-timeout", "2000"})
		addrs = append(addrs, own(t, p, err).Addr)
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ok := true
		for _, a := range addrs {
			host, port, _ := net.SplitHostPort(a)
			out, _ := exec.Command(cli, "-h", host, "-p", port, "cluster", "info").Output()
			ok = ok && strings.Contains(string(out), "cluster_state:ok")
		}
		if ok {
			return addrs
		}
		if time.Now().After(deadline) {
			t.Fatal("the Redis Cluster did not reach cluster_state:ok within 30s")
		}
		time.Sleep(100 * time.Millisecond)
	}
}
