package testsvc

import (
	"fmt"
	"runtime"
	"testing"
)

// Outside runs get (a service function of this package, such as
// [Postgres]) outside any test, for a TestMain that prepares the server
// its runnable examples use, since examples have no *testing.T. It
// returns the service's address; when get skipped or failed (the service
// is not installed, or did not start), it returns "" and get's reason.
// get may call Helper, Fatal, Fatalf, Skip and Skipf on the testing.TB
// it is given; any other method panics.
func Outside(get func(testing.TB) string) (addr, reason string) {
	tb := &outsideTB{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		addr = get(tb)
	}()
	<-done
	if tb.reason != "" {
		return "", tb.reason
	}
	return addr, ""
}

// outsideTB is the testing.TB Outside hands a service function: a skip or
// a failure records its reason and ends get's goroutine, as it would end
// a test's.
type outsideTB struct {
	testing.TB // nil: a method not overridden here panics
	reason     string
}

func (*outsideTB) Helper() {}

func (o *outsideTB) Fatal(args ...any) { o.stop(fmt.Sprint(args...)) }

func (o *outsideTB) Fatalf(format string, args ...any) { o.stop(fmt.Sprintf(format, args...)) }

func (o *outsideTB) Skip(args ...any) { o.stop(fmt.Sprint(args...)) }

func (o *outsideTB) Skipf(format string, args ...any) { o.stop(fmt.Sprintf(format, args...)) }

func (o *outsideTB) stop(reason string) {
	if reason == "" {
		reason = "stopped without a reason"
	}
	o.reason = reason
	runtime.Goexit()
}
