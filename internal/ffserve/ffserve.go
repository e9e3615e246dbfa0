// Package ffserve starts the functions framework on a free loopback port,
// the way the Cloud Run functions buildpack's generated main starts it, for
// tests and the local demo.
package ffserve

import (
	"fmt"
	"net"
	"time"

	"github.com/GoogleCloudPlatform/functions-framework-go/funcframework"
)

// Start serves every function registered so far (or, with FUNCTION_TARGET
// set, that one at "/") on 127.0.0.1 at port, or at a free port when port
// is empty, and returns the base URL once the server accepts connections.
// The server runs until the process exits; if it fails after starting,
// the failure is sent on the returned channel.
func Start(port string) (url string, failed <-chan error, err error) {
	if port == "" {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return "", nil, err
		}
		port = fmt.Sprint(l.Addr().(*net.TCPAddr).Port)
		l.Close()
	}
	addr := "127.0.0.1:" + port
	errc := make(chan error, 1)
	go func() { errc <- funcframework.StartHostPort("127.0.0.1", port) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
			return "http://" + addr, errc, nil
		}
		select {
		case err := <-errc:
			return "", nil, fmt.Errorf("functions framework on %s: %w", addr, err)
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return "", nil, fmt.Errorf("functions framework on %s did not accept connections within 10s: %w", addr, err)
		}
	}
}
