package firestorelock_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/bench"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
)

// How cost grows (docs/scaling/firestore.md): a delivery through Lock at
// 1 to 64 workers, N deliveries racing one key, and PurgeExpired on
// expired records while claims run, all on the emulator.

// BenchmarkScaling is a delivery through Lock at 1, 4, 16 and 64 workers.
func BenchmarkScaling(b *testing.B) {
	testsvc.Firestore(b)
	ctx := context.Background()
	for _, workers := range []int{1, 4, 16, 64} {
		b.Run(fmt.Sprintf("lock/workers=%d", workers), func(b *testing.B) {
			be, r := newBackend(b)
			run := func(key string) error { return idempotency.Lock(ctx, be, key, noop) }
			if err := run("warm-up"); err != nil {
				b.Fatal(err)
			}
			r.take()
			b.ResetTimer()
			bench.Deliveries(b, workers, run)
			b.ReportMetric(float64(len(r.take()))/float64(b.N), "RPCs/delivery")
		})
	}
}

// BenchmarkRace has N deliveries of one key race (N at once, a fresh key
// each round): one runs the body, the others are told it is in progress
// or done. RPCs/key is what the race costs the service.
func BenchmarkRace(b *testing.B) {
	testsvc.Firestore(b)
	ctx := context.Background()
	for _, racers := range []int{2, 8, 32} {
		b.Run(fmt.Sprintf("lock/racers=%d", racers), func(b *testing.B) {
			be, r := newBackend(b)
			var bodies atomic.Int64
			body := func(context.Context) error { bodies.Add(1); return nil }
			run := func(key string) error {
				err := idempotency.Lock(ctx, be, key, body)
				if errors.Is(err, idempotency.ErrInProgress) || errors.Is(err, idempotency.ErrDuplicate) {
					return nil
				}
				return err
			}
			if err := run("warm-up"); err != nil {
				b.Fatal(err)
			}
			bodies.Store(0)
			r.take()
			b.ResetTimer()
			bench.Race(b, racers, run)
			b.StopTimer()
			if n := bodies.Load(); n != int64(b.N) {
				b.Fatalf("%d bodies ran for %d keys", n, b.N)
			}
			b.ReportMetric(float64(len(r.take()))/float64(b.N), "RPCs/key")
		})
	}
}

// purgeRecords is how many expired records BenchmarkPurgeWhileClaiming
// purges: IDEMPOTENCY_PURGE_RECORDS, default 10000.
func purgeRecords(b *testing.B) int {
	if s := os.Getenv("IDEMPOTENCY_PURGE_RECORDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			b.Fatalf("IDEMPOTENCY_PURGE_RECORDS=%q", s)
		}
		return n
	}
	return 10000
}

// BenchmarkPurgeWhileClaiming writes expired records (500 per Commit, as
// an older run would have left them) and times one PurgeExpired over them
// while 4 workers claim fresh keys in the same collection.
func BenchmarkPurgeWhileClaiming(b *testing.B) {
	testsvc.Firestore(b)
	ctx := context.Background()
	n := purgeRecords(b)
	b.Run(fmt.Sprintf("records=%d/claimers=4", n), func(b *testing.B) {
		for range b.N {
			b.StopTimer()
			ns := collection()
			be, _ := newBackend(b, firestorelock.WithCollection(ns))
			seedExpired(b, ns, n)
			b.StartTimer()
			bench.PurgeWhileClaiming(b, n, 4,
				func() (int, error) { return be.PurgeExpired(ctx, 0) },
				func(key string) error { _, err := be.Claim(ctx, key, time.Minute); return err })
		}
	})
}

// seedExpired writes n records of collection coll that expired an hour
// ago.
func seedExpired(b testing.TB, coll string, n int) {
	b.Helper()
	rpc := pb.NewFirestoreClient(dialEmulator(b, testsvc.Firestore(b)))
	db := "projects/" + project + "/databases/" + firestorelock.DefaultDatabase
	past := timestamppb.New(time.Now().Add(-time.Hour))
	for i := 0; i < n; i += 500 {
		writes := make([]*pb.Write, 0, 500)
		for j := i; j < min(n, i+500); j++ {
			writes = append(writes, &pb.Write{Operation: &pb.Write_Update{Update: &pb.Document{
				Name: db + "/documents/" + coll + "/" + firestorelock.Name(fmt.Sprintf("expired-%d", j)),
				Fields: map[string]*pb.Value{
					"state":        {ValueType: &pb.Value_IntegerValue{IntegerValue: 2}},
					"fence":        {ValueType: &pb.Value_IntegerValue{IntegerValue: 1}},
					"lease_expiry": {ValueType: &pb.Value_TimestampValue{TimestampValue: past}},
					"expires_at":   {ValueType: &pb.Value_TimestampValue{TimestampValue: past}},
					"token":        {ValueType: &pb.Value_StringValue{StringValue: "t"}},
				},
			}}})
		}
		if _, err := rpc.Commit(context.Background(), &pb.CommitRequest{Database: db, Writes: writes}); err != nil {
			b.Fatal(err)
		}
	}
}
