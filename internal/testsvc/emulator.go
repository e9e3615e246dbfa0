package testsvc

import (
	"bufio"
	"fmt"
	"net"
	"strings"
	"time"
)

// HTTPReady answers whether GET http://addr/ succeeds, as it does on the
// gcloud emulators once they serve.
func HTTPReady(addr string) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", addr); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if !strings.Contains(line, " 200 ") {
		return fmt.Errorf("GET / answered %q", strings.TrimSpace(line))
	}
	return nil
}

// startEmulator starts a gcloud emulator on a free loopback port, in dir,
// with the arguments args returns for that port, and waits until it
// answers HTTP.
func startEmulator(name, bin, dir string, args func(port int) []string) (*Process, string, error) {
	port, addr, err := freeAddr()
	if err != nil {
		return nil, "", err
	}
	p, err := Start(name, bin, dir, addr, args(port), HTTPReady)
	if err != nil {
		return nil, "", err
	}
	return p, addr, nil
}
