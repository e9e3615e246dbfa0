package testsvc

import (
	"io"
	"net"
	"sync/atomic"
	"testing"
)

// DropProxy forwards TCP connections to a server. Armed, it swallows the
// server's next reply and cuts that connection: the command ran, its answer
// is lost, as when a network fails at the worst moment.
type DropProxy struct {
	ln     net.Listener
	target string
	// Armed, when set, drops the next reply.
	Armed atomic.Bool
	// Dropped counts the replies dropped.
	Dropped atomic.Int32
}

// NewDropProxy listens on a free loopback port and forwards to target
// until t ends.
func NewDropProxy(t testing.TB, target string) *DropProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &DropProxy{ln: ln, target: target}
	go p.serve()
	t.Cleanup(func() { ln.Close() })
	return p
}

// Addr is the proxy's host:port.
func (p *DropProxy) Addr() string { return p.ln.Addr().String() }

func (p *DropProxy) serve() {
	for {
		cc, err := p.ln.Accept()
		if err != nil {
			return
		}
		sc, err := net.Dial("tcp", p.target)
		if err != nil {
			cc.Close()
			continue
		}
		go func() { io.Copy(sc, cc); sc.Close() }()
		go func() {
			defer cc.Close()
			defer sc.Close()
			buf := make([]byte, 64<<10)
			for {
				n, err := sc.Read(buf)
				if n > 0 {
					if p.Armed.CompareAndSwap(true, false) {
						p.Dropped.Add(1)
						return
					}
					if _, err := cc.Write(buf[:n]); err != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
	}
}
