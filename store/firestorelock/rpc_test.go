package firestorelock_test

import (
	"context"
	"io"
	"testing"

	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
)

// The cases of the retries (doclocktest.RunScripted), on connections that
// never reach a server.
func TestScripted(t *testing.T) { doclocktest.RunScripted(t, driver{}) }

const (
	methodBatchGet = "/google.firestore.v1.Firestore/BatchGetDocuments"
	methodCommit   = "/google.firestore.v1.Firestore/Commit"
)

// scriptedConn is a connection that never reaches a server: it answers
// each call with what answer returns for its kind (nil: a read finds
// nothing, with no read_time; a write succeeds with an empty reply), and
// counts the calls by kind. Firestore reads by a stream
// (BatchGetDocuments) and writes by unary calls.
type scriptedConn struct {
	n      *doclocktest.Counts
	answer func(ctx context.Context, kind string) error
}

func (c scriptedConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	if method == methodCommit {
		c.n.Commits.Add(1)
		return c.answer(ctx, "commit")
	}
	c.n.Others.Add(1)
	return c.answer(ctx, "other")
}

func (c scriptedConn) NewStream(ctx context.Context, _ *grpc.StreamDesc, method string, _ ...grpc.CallOption) (grpc.ClientStream, error) {
	kind := "other"
	if method == methodBatchGet {
		kind = "read"
		c.n.Reads.Add(1)
	} else {
		c.n.Others.Add(1)
	}
	return &scriptedStream{ctx: ctx, err: c.answer(ctx, kind)}, nil
}

// scriptedStream answers a read with err, or with one reply saying the
// document is missing.
type scriptedStream struct {
	ctx  context.Context
	err  error
	done bool
}

func (s *scriptedStream) Header() (metadata.MD, error) { return nil, nil }
func (s *scriptedStream) Trailer() metadata.MD         { return nil }
func (s *scriptedStream) CloseSend() error             { return nil }
func (s *scriptedStream) Context() context.Context     { return s.ctx }
func (s *scriptedStream) SendMsg(any) error            { return nil }
func (s *scriptedStream) RecvMsg(m any) error {
	if s.err != nil {
		return s.err
	}
	if s.done {
		return io.EOF
	}
	s.done = true
	if r, ok := m.(*pb.BatchGetDocumentsResponse); ok {
		r.Result = &pb.BatchGetDocumentsResponse_Missing{Missing: "scripted"}
	}
	return nil
}

func (driver) NewScripted(t testing.TB, c doclocktest.Config, answer func(ctx context.Context, kind string) error) (doclocktest.Backend, *doclocktest.Counts) {
	t.Helper()
	n := &doclocktest.Counts{}
	b, err := firestorelock.New(scriptedConn{n: n, answer: answer}, project, options(c)...)
	if err != nil {
		t.Fatal(err)
	}
	return b, n
}

func (driver) Status(code uint32) error { return status.Error(codes.Code(code), "scripted failure") }
func (driver) Code(err error) uint32    { return uint32(status.Code(err)) }
