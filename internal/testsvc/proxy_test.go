package testsvc

import (
	"bufio"
	"net"
	"testing"
	"time"
)

// echo serves lines back on a free loopback port until t ends.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// ask sends line on c and returns the answer, or the error.
func ask(c net.Conn, r *bufio.Reader, line string) (string, error) {
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(line + "\n")); err != nil {
		return "", err
	}
	return r.ReadString('\n')
}

// An armed proxy lets the request through, swallows its reply and cuts that
// connection; the next connection works.
func TestDropProxyLosesTheNextReply(t *testing.T) {
	t.Parallel()
	p := NewDropProxy(t, echo(t))
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	if got, err := ask(c, r, "one"); err != nil || got != "one\n" {
		t.Fatalf("through the proxy: %q, %v", got, err)
	}
	p.LoseNextReply()
	if got, err := ask(c, r, "two"); err == nil {
		t.Fatalf("the armed proxy passed the reply %q", got)
	}
	if p.Dropped.Load() != 1 || p.Armed.Load() {
		t.Fatalf("Dropped = %d, Armed = %v after one lost reply", p.Dropped.Load(), p.Armed.Load())
	}
	c2, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if got, err := ask(c2, bufio.NewReader(c2), "three"); err != nil || got != "three\n" {
		t.Fatalf("a new connection after the loss: %q, %v", got, err)
	}
}

// CutConnections closes every open connection on both sides; new ones work.
func TestDropProxyCutsConnections(t *testing.T) {
	t.Parallel()
	p := NewDropProxy(t, echo(t))
	var conns []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := ask(c, bufio.NewReader(c), "hi"); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	p.CutConnections()
	for _, c := range conns {
		if got, err := ask(c, bufio.NewReader(c), "again"); err == nil {
			t.Fatalf("a cut connection answered %q", got)
		}
	}
	if p.Cuts.Load() != 4 {
		t.Fatalf("Cuts = %d, want 4 (two connections, both sides)", p.Cuts.Load())
	}
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got, err := ask(c, bufio.NewReader(c), "new"); err != nil || got != "new\n" {
		t.Fatalf("a new connection after the cut: %q, %v", got, err)
	}
}
