package datastorelock_test

import (
	"context"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// The cases of the retries (doclocktest.RunScripted), on connections that
// never reach a server.
func TestScripted(t *testing.T) { doclocktest.RunScripted(t, driver{}) }

// scriptedConn is a connection that never reaches a server: it answers
// each call with what answer returns for its kind (nil leaves the reply
// empty: a Lookup finds nothing, with no read_time, as on the emulator),
// and counts the calls by kind. Datastore's calls are all unary.
type scriptedConn struct {
	n      *doclocktest.Counts
	answer func(ctx context.Context, kind string) error
}

func (c scriptedConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	kind := "other"
	switch method {
	case "/google.datastore.v1.Datastore/Lookup":
		kind = "read"
		c.n.Reads.Add(1)
	case "/google.datastore.v1.Datastore/Commit":
		kind = "commit"
		c.n.Commits.Add(1)
	default:
		c.n.Others.Add(1)
	}
	return c.answer(ctx, kind)
}

func (c scriptedConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, status.Error(codes.Unimplemented, "scriptedConn has no streams")
}

func (driver) NewScripted(t testing.TB, c doclocktest.Config, answer func(ctx context.Context, kind string) error) (doclocktest.Backend, *doclocktest.Counts) {
	t.Helper()
	n := &doclocktest.Counts{}
	b, err := datastorelock.New(scriptedConn{n: n, answer: answer}, project, options(c)...)
	if err != nil {
		t.Fatal(err)
	}
	return b, n
}

func (driver) Status(code uint32) error { return status.Error(codes.Code(code), "scripted failure") }
func (driver) Code(err error) uint32    { return uint32(status.Code(err)) }
