package testsvc

import (
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// DropProxy forwards TCP connections to a server. Armed, it swallows the
// server's next reply and cuts that connection: the command ran, its answer
// is lost, as when a network fails at the worst moment. It implements
// storetest.Faults.
type DropProxy struct {
	ln     net.Listener
	target string
	// Armed, when set, drops the next reply.
	Armed atomic.Bool
	// Dropped counts the replies dropped.
	Dropped atomic.Int32
	// Cuts counts the connections closed by CutConnections.
	Cuts atomic.Int32

	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

// NewDropProxy listens on a free loopback port and forwards to target
// until t ends.
func NewDropProxy(t testing.TB, target string) *DropProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &DropProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	go p.serve()
	t.Cleanup(func() { ln.Close(); p.CutConnections() })
	return p
}

// Addr is the proxy's host:port.
func (p *DropProxy) Addr() string { return p.ln.Addr().String() }

// LoseNextReply arms the proxy: the next reply the server sends on any
// connection is swallowed and that connection is cut.
func (p *DropProxy) LoseNextReply() { p.Armed.Store(true) }

// CutConnections closes every connection open through the proxy now, on
// both sides; calls in flight fail mid-way. New connections still work.
func (p *DropProxy) CutConnections() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
		delete(p.conns, c)
		p.Cuts.Add(1)
	}
}

func (p *DropProxy) track(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
}

func (p *DropProxy) forget(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
	}
}

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
		p.track(cc, sc)
		go func() { io.Copy(sc, cc); sc.Close() }()
		go func() {
			defer p.forget(cc, sc)
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
