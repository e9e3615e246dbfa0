// Package datastorelock is a store.Backend on Firestore in Datastore mode
// (and the Datastore emulator), the production default for Cloud Run.
//
// # Two RPCs per delivery
//
// The backend speaks the Datastore v1 gRPC API directly, because the
// high-level client exposes neither an entity's version nor a mutation's
// base_version, and those make transactions unnecessary:
//
//   - Claim on a fresh key is one non-transactional Commit with an insert
//     mutation: it creates the record, or fails with AlreadyExists.
//   - Claim on an existing key is a Lookup (strongly consistent by key) and,
//     when the record is reclaimable, one update conditioned on the version
//     the Lookup saw (base_version): 2 or 3 RPCs in all. A concurrent writer
//     makes the update report conflict_detected instead of applying; the
//     claim then looks again.
//   - Complete, Release and Extend are one update conditioned on the
//     version the claim left (Claim.Rev), so a record that anyone changed
//     since is never overwritten; on conflict a Lookup decides.
//
// # The record
//
// One entity per key, of kind "IdempotencyKey" (WithKind) in the default
// namespace (WithNamespace), named by the key. A key that is not valid
// UTF-8, or that starts with "~", or that Datastore reserves (__name__), is
// stored under "~" + base64url(key) instead: the mapping is one-to-one, and
// a 1024-byte key still fits Datastore's 1500-byte name limit.
//
//	state         integer    1 claimed, 2 done            not indexed
//	fence         integer    the fencing token            not indexed
//	lease_expiry  timestamp  when the holder's lease ends not indexed
//	expires_at    timestamp  when the record may go       indexed (PurgeExpired, TTL policy)
//	token         string     the winning Claim's token    not indexed
//
// A TTL policy on expires_at lets Datastore delete expired records by
// itself (within a day after expires_at, never before):
//
//	gcloud firestore fields ttls update expires_at \
//	    --collection-group=IdempotencyKey --enable-ttl
//
// Without one, call PurgeExpired now and then.
//
// # Clock
//
// Leases and ttls are judged by the service's clock wherever the service
// reports it, so that an instance whose clock runs fast cannot take a live
// lease or end a ttl early, and one whose clock runs slow cannot store a
// lease that has lapsed already:
//
//   - A Lookup judges the record it read by the reply's read_time.
//   - A write that follows a read in the same call (a reclaim; an insert
//     after a read found the key absent; Complete, Release or Extend after
//     a conflict or a stale estimate) bases its instants on that read's
//     read_time carried forward by the time elapsed since its reply
//     arrived: an instant between the read and the server's now.
//   - Any other write (the first insert of a fresh key; Complete, Release
//     and Extend on their first try) bases them on an estimate that is never
//     earlier than the server's time when the request is sent: a server
//     timestamp seen (read_time of a Lookup or RunQuery, commit_time of a
//     Commit, else the update_time of an applied mutation) plus the time
//     elapsed on this process's monotonic clock since the request that
//     brought it was sent, the least such bound of the last minute (it runs
//     ahead by the one-way latency of the fastest recent request, a
//     millisecond or so). When the commit's own timestamp shows that the
//     estimate ran ahead of it by more than 100ms, the call reports an
//     unknown outcome (an error) rather than instants outside its span.
//   - Either way a lease runs for at least its length from a server instant
//     within the Claim call, and the LeaseExpiry a claim reports is exactly
//     the one stored; a Done record's ttl runs from an instant within the
//     Complete call.
//   - An estimate older than a minute is not trusted (clock rates drift by
//     up to a few milliseconds a minute):
//     Claim then reads the record before it writes, and Complete, Release,
//     Extend and PurgeExpired read before they write, which costs one RPC
//     after an idle minute. The first Claim of a Backend reads first for the
//     same reason.
//   - PurgeExpired queries for records expired by the lower bound of the
//     server's time and deletes only those whose expires_at is not after the
//     query's read_time, each with a versioned delete.
//
// The Datastore emulator sets neither read_time nor commit_time (nor
// update_time). When the first read's reply carries no read_time, the
// Backend judges by the client's clock until a reply carries a server
// timestamp, which on the emulator is never: there, instances whose clocks
// disagree by s shift each other's view of a lease by s, so keep lease and
// ttl far above any plausible skew (Cloud Run instances are
// NTP-synchronized to well under a second). Once the service has reported
// its time, a read whose reply lacks it is judged by the lower bound of the
// estimate, or fails when there is no recent one.
//
// # Retries
//
// Every RPC is retried after Unavailable, Aborted, ResourceExhausted,
// Internal or DeadlineExceeded (WithRetries). A retried write may have
// applied although its reply was lost; the token of the Claim call tells
// its own write apart, and a Claim that finds it answers Won with it (its
// lease may have lapsed meanwhile, as it may while any reply travels). When
// a retry finds the record in other hands (or gone) at a time when, had the
// lost write applied, others could already have taken the key from it,
// Claim cannot tell whether it won and returns an error, never HeldByOther
// or AlreadyDone; Complete does the same. A Claim whose own record expired
// before the call could answer returns an error too: the record could be
// deleted at any moment and the fence start again at 1. Complete, Release
// and Extend recognise their own lost write and do not apply it twice.
package datastorelock

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/api/option"
	gtransport "google.golang.org/api/transport/grpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// DefaultKind is the entity kind records are stored under.
const DefaultKind = "IdempotencyKey"

// Property names of a record.
const (
	propState     = "state"
	propFence     = "fence"
	propLease     = "lease_expiry"
	propExpiresAt = "expires_at"
	propToken     = "token"
)

const (
	stateClaimed = 1
	stateDone    = 2
)

// Option configures a Backend.
type Option func(*Backend)

// WithDatabase selects a named database; the default is "(default)".
func WithDatabase(id string) Option { return func(b *Backend) { b.database = id } }

// WithNamespace stores records in a namespace.
func WithNamespace(ns string) Option { return func(b *Backend) { b.namespace = ns } }

// WithKind sets the entity kind; the default is DefaultKind.
func WithKind(kind string) Option { return func(b *Backend) { b.kind = kind } }

// WithTTL sets how long a completed key suppresses duplicates, and how long
// a claimed record outlives its lease. Default store.DefaultTTL.
func WithTTL(ttl time.Duration) Option { return func(b *Backend) { b.ttl = ttl } }

// WithClientOptions passes options to the gRPC transport (credentials, an
// endpoint, dial options).
func WithClientOptions(opts ...option.ClientOption) Option {
	return func(b *Backend) { b.clientOpts = append(b.clientOpts, opts...) }
}

// WithClock makes the backend read the client's time from now instead of
// time.Now, for tests. It also measures the time elapsed since a server
// timestamp arrived (time.Now's monotonic reading makes that immune to
// steps of the wall clock).
func WithClock(now func() time.Time) Option { return func(b *Backend) { b.now = now } }

// WithRetries sets how many times an operation is retried after an
// Unavailable or Aborted error, within its context. Default 5.
func WithRetries(n int) Option { return func(b *Backend) { b.retries = n } }

// Backend is a store.Backend on Firestore in Datastore mode. It is safe for
// concurrent use. Close it when done.
type Backend struct {
	project, database, namespace, kind string
	ttl                                time.Duration
	retries                            int
	now                                func() time.Time
	clientOpts                         []option.ClientOption

	conn gtransport.ConnPool
	rpc  pb.DatastoreClient
	md   metadata.MD

	sc serverClock
}

var (
	_ store.Backend  = (*Backend)(nil)
	_ store.Extender = (*Backend)(nil)
	_ store.Purger   = (*Backend)(nil)
)

// New dials Datastore for project. An empty project is read from
// DATASTORE_PROJECT_ID, then GOOGLE_CLOUD_PROJECT. When
// DATASTORE_EMULATOR_HOST is set it dials that emulator without
// credentials, as the official client does; otherwise it uses Application
// Default Credentials unless WithClientOptions says otherwise.
func New(ctx context.Context, project string, opts ...Option) (*Backend, error) {
	b := &Backend{kind: DefaultKind, ttl: store.DefaultTTL, retries: 5, now: time.Now}
	for _, o := range opts {
		o(b)
	}
	if project == "" {
		project = os.Getenv("DATASTORE_PROJECT_ID")
	}
	if project == "" {
		project = os.Getenv("GOOGLE_CLOUD_PROJECT")
	}
	if project == "" {
		return nil, errors.New("datastorelock: no project ID (pass one, or set DATASTORE_PROJECT_ID or GOOGLE_CLOUD_PROJECT)")
	}
	b.project = project
	if err := store.ValidateTTL(b.ttl); err != nil {
		return nil, fmt.Errorf("datastorelock: %w", err)
	}
	b.ttl = wholeMicros(b.ttl)
	if b.kind == "" || strings.HasPrefix(b.kind, "__") {
		return nil, fmt.Errorf("datastorelock: invalid kind %q", b.kind)
	}
	if b.retries < 0 {
		return nil, fmt.Errorf("datastorelock: retries %d is negative", b.retries)
	}
	var dial []option.ClientOption
	if addr := os.Getenv("DATASTORE_EMULATOR_HOST"); addr != "" {
		addr = strings.TrimPrefix(strings.TrimPrefix(addr, "http://"), "https://")
		dial = []option.ClientOption{
			option.WithEndpoint("passthrough:///" + addr),
			option.WithoutAuthentication(),
			option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())),
		}
	} else {
		dial = []option.ClientOption{
			option.WithEndpoint("datastore.googleapis.com:443"),
			option.WithScopes("https://www.googleapis.com/auth/datastore"),
		}
	}
	conn, err := gtransport.DialPool(ctx, append(dial, b.clientOpts...)...)
	if err != nil {
		return nil, fmt.Errorf("datastorelock: dialing: %w", err)
	}
	b.conn = conn
	b.rpc = pb.NewDatastoreClient(conn)
	prefix := "projects/" + project
	params := "project_id=" + project
	if b.database != "" {
		prefix += "/databases/" + b.database
		params += "&database_id=" + b.database
	}
	b.md = metadata.Pairs("google-cloud-resource-prefix", prefix, "x-goog-request-params", params)
	return b, nil
}

// Close closes the connections.
func (b *Backend) Close() error { return b.conn.Close() }

// TTL returns the ttl the backend applies.
func (b *Backend) TTL() time.Duration { return b.ttl }

// Name returns the entity name a key is stored under: the key itself when
// it is valid UTF-8, does not start with "~" and does not both start and
// end with "__"; else "~" followed by the key in unpadded base64url. Distinct
// keys get distinct names.
func Name(key string) string {
	if utf8.ValidString(key) && !strings.HasPrefix(key, "~") && !(strings.HasPrefix(key, "__") && strings.HasSuffix(key, "__")) {
		return key
	}
	return "~" + base64.RawURLEncoding.EncodeToString([]byte(key))
}

// keyOf is the inverse of Name: the key stored under name, and false for a
// name that Name does not produce.
func keyOf(name string) (string, bool) {
	key := name
	if rest, ok := strings.CutPrefix(name, "~"); ok {
		raw, err := base64.RawURLEncoding.DecodeString(rest)
		if err != nil {
			return "", false
		}
		key = string(raw)
	}
	if Name(key) != name {
		return "", false
	}
	return key, true
}

func (b *Backend) ctx(ctx context.Context) context.Context {
	return metadata.NewOutgoingContext(ctx, b.md)
}

func (b *Backend) dsKey(key string) *pb.Key {
	return &pb.Key{
		PartitionId: &pb.PartitionId{ProjectId: b.project, DatabaseId: b.database, NamespaceId: b.namespace},
		Path:        []*pb.Key_PathElement{{Kind: b.kind, IdType: &pb.Key_PathElement_Name{Name: Name(key)}}},
	}
}

// record is the decoded entity.
type record struct {
	state      int64
	fence      int64
	lease, exp time.Time
	token      string
	version    int64
}

func (b *Backend) entity(key string, r record) *pb.Entity {
	ts := func(t time.Time) *pb.Value {
		return &pb.Value{ValueType: &pb.Value_TimestampValue{TimestampValue: timestamppb.New(t)}, ExcludeFromIndexes: true}
	}
	exp := ts(r.exp)
	exp.ExcludeFromIndexes = false
	return &pb.Entity{
		Key: b.dsKey(key),
		Properties: map[string]*pb.Value{
			propState:     {ValueType: &pb.Value_IntegerValue{IntegerValue: r.state}, ExcludeFromIndexes: true},
			propFence:     {ValueType: &pb.Value_IntegerValue{IntegerValue: r.fence}, ExcludeFromIndexes: true},
			propLease:     ts(r.lease),
			propExpiresAt: exp,
			propToken:     {ValueType: &pb.Value_StringValue{StringValue: r.token}, ExcludeFromIndexes: true},
		},
	}
}

func decode(res *pb.EntityResult) (record, error) {
	p := res.GetEntity().GetProperties()
	r := record{
		state:   p[propState].GetIntegerValue(),
		fence:   p[propFence].GetIntegerValue(),
		lease:   p[propLease].GetTimestampValue().AsTime(),
		exp:     p[propExpiresAt].GetTimestampValue().AsTime(),
		token:   p[propToken].GetStringValue(),
		version: res.GetVersion(),
	}
	if (r.state != stateClaimed && r.state != stateDone) || r.fence < 1 {
		return r, fmt.Errorf("datastorelock: entity %v is not a record of this backend (state %d, fence %d)",
			res.GetEntity().GetKey(), r.state, r.fence)
	}
	return r, nil
}

// wholeMicros rounds d up to a whole microsecond. Datastore keeps
// timestamps in microseconds: instants are computed from bases in whole
// microseconds plus durations rounded up this way, so what is stored is
// exactly what a claim reports, never a fraction of a microsecond earlier.
func wholeMicros(d time.Duration) time.Duration {
	return (d + time.Microsecond - 1).Truncate(time.Microsecond)
}

func (b *Backend) clock() time.Time { return b.now().UTC().Truncate(time.Microsecond) }

// maxObservationAge is how long a server timestamp serves as the base of an
// estimate of the server's time. Clock rates differ by up to a few hundred
// parts per million: a few milliseconds a minute.
const maxObservationAge = time.Minute

// clockMode says whose clock the backend judges by.
type clockMode int

const (
	modeUnknown clockMode = iota // nothing read yet
	modeServer                   // the service reports its time
	modeClient                   // it does not (the emulator): the client's clock
)

// serverClock estimates the service's clock from the timestamps its replies
// carry. Each reply bounds the server's time: no later than its timestamp
// plus the time elapsed since its request was sent, no earlier than its
// timestamp plus the time elapsed since the reply arrived. It keeps the
// tightest of each bound seen within maxObservationAge, so one slow reply
// does not stretch the estimate.
type serverClock struct {
	mu     sync.Mutex
	mode   clockMode
	hi, lo observation
}

// observation is a server timestamp and the client's clock when the
// request that brought it was sent and when its reply arrived.
type observation struct {
	at, sent, recv time.Time
}

// upper and lower are the bounds o sets on the server's time at the
// client's now (which, like sent and recv, carries time.Now's monotonic
// reading when it comes from time.Now).
func (o observation) upper(now time.Time) time.Time { return o.at.Add(now.Sub(o.sent)) }
func (o observation) lower(now time.Time) time.Time { return o.at.Add(now.Sub(o.recv)) }

// stale reports whether o is missing or too old to base an estimate on.
func (o observation) stale(now time.Time) bool {
	age := now.Sub(o.recv)
	return o.recv.IsZero() || age < 0 || age > maxObservationAge
}

// observe records the server timestamp ts of a reply (nil when it carries
// none) to a request sent at sent whose reply arrived at recv. A read whose
// reply carries none, before any did, means the service keeps no clock for
// us (the emulator).
func (b *Backend) observe(ts *timestamppb.Timestamp, sent, recv time.Time, read bool) {
	b.sc.mu.Lock()
	defer b.sc.mu.Unlock()
	if ts == nil || !ts.IsValid() {
		if read && b.sc.mode == modeUnknown {
			b.sc.mode = modeClient
		}
		return
	}
	b.sc.mode = modeServer
	o := observation{at: ts.AsTime(), sent: sent, recv: recv}
	if b.sc.hi.stale(recv) || o.upper(recv).Before(b.sc.hi.upper(recv)) {
		b.sc.hi = o
	}
	if b.sc.lo.stale(recv) || o.lower(recv).After(b.sc.lo.lower(recv)) {
		b.sc.lo = o
	}
}

// times returns a lower and an upper bound of the server's time now. ok is
// false when there is no recent server timestamp (read first). With the
// client's clock both bounds are its now.
func (b *Backend) times() (lo, hi time.Time, ok bool) {
	b.sc.mu.Lock()
	defer b.sc.mu.Unlock()
	switch b.sc.mode {
	case modeClient:
		now := b.clock()
		return now, now, true
	case modeServer:
		now := b.now()
		if b.sc.hi.stale(now) || b.sc.lo.stale(now) {
			return time.Time{}, time.Time{}, false
		}
		lo = b.sc.lo.lower(now).Truncate(time.Microsecond)
		hi = b.sc.hi.upper(now).Add(time.Microsecond - 1).Truncate(time.Microsecond)
		return lo, hi, true
	}
	return time.Time{}, time.Time{}, false
}

// estimateSlack is how far the estimate of the server's time that a write
// was based on may run ahead of the time the service gave the commit
// (outbound latency, clock drift) before the write counts as misplaced.
const estimateSlack = 100 * time.Millisecond

// misplaced reports whether a write based on the estimate base landed at
// server time at (zero when unknown) that is well before base: the
// estimate ran ahead (it was taken from a request that was slow to
// arrive), so the write's instants lie after the call. Its outcome is
// then reported as unknown rather than with instants the call did not see.
func misplaced(base, at time.Time) bool {
	return !at.IsZero() && base.After(at.Add(estimateSlack))
}

// errNoServerTime reports a reply without the server's time from a service
// that otherwise gives it, with no recent estimate to fall back on.
var errNoServerTime = errors.New("datastorelock: the reply carries no read_time and no recent server time is known")

// judge returns the instant to judge a read by: the reply's read_time, else
// the lower bound of the server's time (the client's clock on the emulator).
func (b *Backend) judge(readTime *timestamppb.Timestamp) (time.Time, error) {
	if readTime != nil && readTime.IsValid() {
		return readTime.AsTime(), nil
	}
	lo, _, ok := b.times()
	if !ok {
		return time.Time{}, errNoServerTime
	}
	return lo, nil
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// retry runs op until it succeeds, fails in a way a retry cannot fix, or
// the budget or ctx runs out.
func (b *Backend) retry(ctx context.Context, op func() error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	var err error
	for attempt := 0; ; attempt++ {
		err = op()
		if err != nil && ctx.Err() != nil {
			// Let errors.Is see the context's error through gRPC's status.
			return fmt.Errorf("%w: %w", ctx.Err(), err)
		}
		if err == nil || attempt >= b.retries {
			return err
		}
		switch status.Code(err) {
		case codes.Unavailable, codes.Aborted, codes.ResourceExhausted, codes.Internal:
		case codes.DeadlineExceeded:
			// A per-call deadline of the transport; ctx itself is still live.
		default:
			return err
		}
		backoff := time.Duration(10<<min(attempt, 6)) * time.Millisecond
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %w", ctx.Err(), err)
		case <-time.After(backoff):
		}
	}
}

// reading is when a read was judged: the server's read_time when the reply
// carried one (exact), else the estimate judge fell back on; and the
// client's clock when the reply arrived.
type reading struct {
	at, recv time.Time
	exact    bool
}

// after returns the instant to base a write that follows read rd on: the
// read's read_time carried forward by the time elapsed since its reply
// arrived, which lies between the read and the server's now. Without a
// read_time, the upper bound of the server's time (the client's clock on
// the emulator).
func (b *Backend) after(rd reading) (time.Time, bool) {
	if rd.exact {
		return rd.at.Add(max(b.now().Sub(rd.recv), 0)).Truncate(time.Microsecond), true
	}
	_, hi, ok := b.times()
	return hi, ok
}

// lookup reads the record for key; found is false when it does not exist.
// rd.at is the instant to judge it by (see judge).
func (b *Backend) lookup(ctx context.Context, key string) (r record, found bool, rd reading, err error) {
	return b.lookupKey(ctx, b.dsKey(key))
}

func (b *Backend) lookupKey(ctx context.Context, k *pb.Key) (r record, found bool, rd reading, err error) {
	err = b.retry(ctx, func() error {
		sent := b.now()
		res, err := b.rpc.Lookup(b.ctx(ctx), &pb.LookupRequest{
			ProjectId:  b.project,
			DatabaseId: b.database,
			Keys:       []*pb.Key{k},
		})
		if err != nil {
			return err
		}
		rd.recv = b.now()
		b.observe(res.GetReadTime(), sent, rd.recv, true)
		rd.exact = res.GetReadTime() != nil && res.GetReadTime().IsValid()
		if rd.at, err = b.judge(res.GetReadTime()); err != nil {
			return err
		}
		if len(res.Deferred) > 0 {
			return status.Error(codes.Unavailable, "lookup deferred the key")
		}
		if len(res.Found) == 0 {
			found = false
			return nil
		}
		r, err = decode(res.Found[0])
		found = err == nil
		return err
	})
	return r, found, rd, err
}

// probeName is an entity name that Name never returns ("!" is not in the
// base64url alphabet): PurgeExpired reads it for the server's time.
const probeName = "~probe!"

// probe reads the server's time (or learns that the service gives none).
func (b *Backend) probe(ctx context.Context) error {
	k := b.dsKey("")
	k.Path[0].IdType = &pb.Key_PathElement_Name{Name: probeName}
	_, _, _, err := b.lookupKey(ctx, k)
	return err
}

// commitTime is the server's time in a Commit reply: commit_time, else the
// latest update_time of an applied mutation (a conflicting one reports the
// entity's older update time), else nil.
func commitTime(res *pb.CommitResponse) *timestamppb.Timestamp {
	if ts := res.GetCommitTime(); ts != nil {
		return ts
	}
	var latest *timestamppb.Timestamp
	for _, mr := range res.GetMutationResults() {
		ts := mr.GetUpdateTime()
		if mr.GetConflictDetected() || ts == nil || !ts.IsValid() {
			continue
		}
		if latest == nil || ts.AsTime().After(latest.AsTime()) {
			latest = ts
		}
	}
	return latest
}

// mayHaveApplied reports whether a Commit that failed with err may have
// been applied all the same (its reply was lost, or the call was cut).
func mayHaveApplied(err error) bool {
	switch status.Code(err) {
	case codes.AlreadyExists, codes.NotFound, codes.InvalidArgument, codes.FailedPrecondition,
		codes.PermissionDenied, codes.Unauthenticated, codes.OutOfRange, codes.Unimplemented:
		return false
	}
	return true
}

// write commits one mutation outside any transaction and returns the
// entity's new version and the commit's server time (zero when the reply
// carries none); applied is false when base_version conflicted.
// AlreadyExists (an insert of an existing key) is returned as is. lost is
// the error of the latest attempt that failed in a way that leaves open
// whether the server applied it: then the mutation may have applied even
// when err is set or applied is false (a retry finds its own write).
func (b *Backend) write(ctx context.Context, m *pb.Mutation) (version int64, applied bool, at time.Time, lost, err error) {
	err = b.retry(ctx, func() error {
		sent := b.now()
		res, err := b.rpc.Commit(b.ctx(ctx), &pb.CommitRequest{
			ProjectId:  b.project,
			DatabaseId: b.database,
			Mode:       pb.CommitRequest_NON_TRANSACTIONAL,
			Mutations:  []*pb.Mutation{m},
		})
		if err != nil {
			if mayHaveApplied(err) {
				lost = err
			}
			return err
		}
		ct := commitTime(res)
		b.observe(ct, sent, b.now(), false)
		if ct != nil && ct.IsValid() {
			at = ct.AsTime()
		}
		if len(res.MutationResults) != 1 {
			return fmt.Errorf("commit returned %d mutation results, want 1", len(res.MutationResults))
		}
		mr := res.MutationResults[0]
		version, applied = mr.Version, !mr.ConflictDetected
		return nil
	})
	return version, applied, at, lost, err
}

func insert(e *pb.Entity) *pb.Mutation {
	return &pb.Mutation{Operation: &pb.Mutation_Insert{Insert: e}}
}

func update(e *pb.Entity, base int64) *pb.Mutation {
	return &pb.Mutation{
		Operation:                 &pb.Mutation_Update{Update: e},
		ConflictDetectionStrategy: &pb.Mutation_BaseVersion{BaseVersion: base},
	}
}

// maxRounds bounds how often Claim re-reads after losing a race.
const maxRounds = 32

// Claim implements store.Backend: an insert for a fresh key (1 RPC), else a
// lookup and, to reclaim, a versioned update (2 or 3 RPCs). Without a
// recent server timestamp it reads before it inserts.
//
// A retry that cannot tell whether a write of this call whose reply was
// lost had won returns an error, not HeldByOther or AlreadyDone: that is
// when the record is found in other hands at or after the lease that write
// would have stored (before it, nobody could have taken the key from it).
func (b *Backend) Claim(ctx context.Context, key string, lease time.Duration) (store.Result, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Result{}, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return store.Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return store.Result{}, fmt.Errorf("datastorelock: claim %q: %w", key, err)
	}
	lease = wholeMicros(lease)
	token := store.NewToken()
	// pending is the latest lease that a write of this call whose reply
	// was lost may have stored; lost is that write's error.
	var (
		pending time.Time
		lost    error
	)
	_, _, tryInsert := b.times()
	var absent *reading // the read of this call that found no record
	for range maxRounds {
		if tryInsert {
			// Base the lease on the read that found the key absent, or
			// else on the estimate of the server's time.
			_, hi, ok := b.times()
			estimated := true
			if absent != nil {
				hi, ok = b.after(*absent)
				estimated = !absent.exact
			}
			if ok {
				rec := record{state: stateClaimed, fence: 1, lease: hi.Add(lease), token: token}
				rec.exp = rec.lease.Add(b.ttl)
				v, _, at, lostNow, err := b.write(ctx, insert(b.entity(key, rec)))
				if lostNow != nil {
					pending, lost = later(pending, rec.lease), lostNow
				}
				if err == nil {
					if b.expired(rec, lost) {
						return store.Result{}, b.expiredErr(key, rec, lost)
					}
					if estimated && misplaced(hi, at) {
						return store.Result{}, b.unknown(key, fmt.Errorf("the claim was written with a lease from %v, "+
							"an estimate of the server's time that ran ahead of the commit at %v", hi, at))
					}
					return won(key, rec, v), nil
				}
				if status.Code(err) != codes.AlreadyExists {
					return store.Result{}, b.unknown(key, err)
				}
			}
		}
		cur, found, rd, err := b.lookup(ctx, key)
		if err != nil {
			return store.Result{}, b.unknown(key, err)
		}
		now := rd.at
		absent = nil
		if !found {
			// Never written, or deleted after it expired. Had a lost write
			// of this call landed, the record would stay until at least its
			// lease + ttl.
			if lost != nil && !now.Before(pending.Add(b.ttl)) {
				return store.Result{}, fmt.Errorf("datastorelock: claim %q: outcome unknown: a write of this call may have won the key "+
					"with a lease to %v, and the record, found gone at %v, could have expired since: %w", key, pending, now, lost)
			}
			tryInsert, absent = true, &rd
			continue
		}
		mine := cur.token == token
		switch {
		case mine && cur.state == stateClaimed && now.Before(cur.exp):
			// An earlier try of this call won; its reply was lost. Its
			// lease may have lapsed while the call retried, as it may
			// while any reply travels: the claim is answered as it was
			// won (a renewal would be a second effect of one call).
			return won(key, cur, cur.version), nil
		case mine:
			// It won, but the record expired while the call retried: it
			// may be deleted at any moment and the fence start again at 1.
			return store.Result{}, b.expiredErr(key, cur, lost)
		case lost != nil && !now.Before(pending):
			return store.Result{}, fmt.Errorf("datastorelock: claim %q: outcome unknown: a write of this call may have won the key "+
				"with a lease to %v, and the record, found in other hands at %v, could have changed hands since: %w",
				key, pending, now, lost)
		case cur.state == stateDone && now.Before(cur.exp):
			return store.Result{Outcome: store.AlreadyDone, Until: cur.exp}, nil
		case cur.state == stateClaimed && now.Before(cur.lease):
			return store.Result{Outcome: store.HeldByOther, Until: cur.lease}, nil
		}
		// Reclaimable: the new lease runs from the read that judged it,
		// carried forward to the update.
		base, ok := b.after(rd)
		if !ok {
			return store.Result{}, b.unknown(key, errNoServerTime)
		}
		next := record{state: stateClaimed, fence: cur.fence + 1, lease: base.Add(lease), token: token}
		next.exp = next.lease.Add(b.ttl)
		v, applied, _, lostNow, err := b.write(ctx, update(b.entity(key, next), cur.version))
		if lostNow != nil {
			pending, lost = later(pending, next.lease), lostNow
		}
		if err != nil {
			if status.Code(err) == codes.NotFound {
				tryInsert = false // deleted since the lookup: look again
				continue
			}
			return store.Result{}, b.unknown(key, err)
		}
		if applied {
			if b.expired(next, lost) {
				return store.Result{}, b.expiredErr(key, next, lost)
			}
			return won(key, next, v), nil
		}
		// Someone wrote the record since the lookup (or our own update
		// applied and its reply was lost): look again.
		tryInsert = false
	}
	return store.Result{}, fmt.Errorf("datastorelock: claim %q: still contended after %d rounds", key, maxRounds)
}

// expired reports whether a claim that this call wrote after a lost reply
// (lost is not nil) belongs to a record past its expires-at instant: the
// retries outlasted lease and ttl, and the record may have been purged and
// written again by a retried insert. It may be deleted at any moment, and
// the next claim would start again at fence 1: the call must not hand it
// out.
func (b *Backend) expired(r record, lost error) bool {
	if lost == nil {
		return false
	}
	lo, _, ok := b.times()
	return !ok || !lo.Before(r.exp)
}

func (b *Backend) expiredErr(key string, r record, lost error) error {
	if lost == nil {
		lost = errors.New("reply lost")
	}
	return fmt.Errorf("datastorelock: claim %q: this call won fence %d, but a reply was lost and the record expired at %v "+
		"before the call could answer (the key is free to claim): %w", key, r.fence, r.exp, lost)
}

func won(key string, r record, version int64) store.Result {
	return store.Result{Outcome: store.Won, Claim: store.Claim{
		Key: key, Fence: r.fence, Token: r.token, LeaseExpiry: r.lease, Rev: version,
	}}
}

func (b *Backend) unknown(key string, err error) error {
	return fmt.Errorf("datastorelock: claim %q (outcome unknown: the key may be held until its lease lapses): %w", key, err)
}

// holds reports whether r is the record claim c won (or what c's own
// changes made of it): the same fence and token. The token tells c apart
// from a claim with the same fence on a record created afresh after an
// earlier one was deleted.
func holds(r record, c store.Claim) bool { return r.fence == c.Fence && r.token == c.Token }

// sameRecord reports whether a and b hold the same values (versions
// aside).
func sameRecord(a, b record) bool {
	return a.state == b.state && a.fence == b.fence && a.token == b.token && a.lease.Equal(b.lease) && a.exp.Equal(b.exp)
}

// takeable is the instant from which a party other than the writer may
// change record r: a Claimed record once its lease lapses, a Done one once
// its ttl ends.
func takeable(r record) time.Time {
	if r.state == stateDone {
		return r.exp
	}
	return r.lease
}

// changed is what change found or did.
type changed struct {
	rec   record // the record as written, or as last read (when found)
	found bool   // a record exists
	wrote bool   // this call's write applied
	// unsure: a write of this call whose reply was lost may have applied,
	// and the record was then found without the claim's fence (or gone) at
	// a time when others could have changed it since: the caller cannot
	// tell whether its write happened. lost is that write's error.
	unsure bool
	lost   error
}

// change applies f to the record of claim c with a versioned update. f sees
// the current record and the server's time now (its upper bound), and says
// what to write, or stops. Only the claim's fence and token entitle a change.
//
// When the claim carries the entity's version and the server's time is
// known, the first round trusts the claim's own view of the record and
// skips the lookup: if the record changed since, the versioned update does
// not apply, and the next round reads it.
func (b *Backend) change(ctx context.Context, c store.Claim, f func(cur record, now time.Time) (next record, write bool)) (changed, error) {
	cur := fromClaim(c, b.ttl)
	known := c.Rev != 0
	var (
		pending time.Time
		lost    error
		sent    []record // what the writes whose replies were lost carried
	)
	for range maxRounds {
		_, now, fresh := b.times()
		read := false
		if !known || !fresh {
			r, found, rd, err := b.lookup(ctx, c.Key)
			if err != nil {
				return changed{}, err
			}
			readAt := rd.at
			if found && slices.ContainsFunc(sent, func(s record) bool { return sameRecord(s, r) }) {
				// A write of this call landed; its reply was lost. Writing
				// again would be a second effect.
				return changed{rec: r, found: true, wrote: true}, nil
			}
			if lost != nil && (!found || !holds(r, c)) && !readAt.Before(pending) {
				return changed{rec: r, found: found, unsure: true, lost: lost}, nil
			}
			if !found {
				return changed{}, nil
			}
			cur, known, read = r, true, true
			if now, fresh = b.after(rd); !fresh {
				return changed{}, errNoServerTime
			}
		}
		next, write := f(cur, now)
		if !write {
			return changed{rec: cur, found: true}, nil
		}
		v, applied, at, lostNow, err := b.write(ctx, update(b.entity(c.Key, next), cur.version))
		if lostNow != nil {
			pending, lost, sent = later(pending, takeable(next)), lostNow, append(sent, next)
		}
		if status.Code(err) == codes.NotFound {
			known = false // gone: read to be sure, and to tell a lost write
			continue
		}
		if err != nil {
			return changed{}, err
		}
		if applied {
			if !read && misplaced(now, at) {
				return changed{}, fmt.Errorf("outcome unknown: written with instants from %v, an estimate of the server's time "+
					"that ran ahead of the commit at %v", now, at)
			}
			next.version = v
			return changed{rec: next, found: true, wrote: true}, nil
		}
		known = false // changed under us: read it and decide again
	}
	return changed{}, fmt.Errorf("still contended after %d rounds", maxRounds)
}

// fromClaim is what the record looks like while c holds it unchanged, for
// an update that knows the version but has not read the entity.
func fromClaim(c store.Claim, ttl time.Duration) record {
	return record{state: stateClaimed, fence: c.Fence, lease: c.LeaseExpiry, exp: c.LeaseExpiry.Add(ttl), token: c.Token, version: c.Rev}
}

// Complete implements store.Backend: one versioned update when the claim
// is unchanged. The Done record expires a ttl after the server's time (its
// upper bound) when the update was sent. When a retry after a lost reply
// finds the record in other hands at a time when the completion, had it
// applied, could already have expired and been reclaimed, Complete returns
// an error: it cannot tell.
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	res, err := b.change(ctx, c, func(cur record, now time.Time) (record, bool) {
		if !holds(cur, c) || cur.state == stateDone {
			return cur, false
		}
		cur.state, cur.exp = stateDone, now.Add(b.ttl)
		return cur, true
	})
	if err != nil {
		return false, fmt.Errorf("datastorelock: complete %q fence %d: %w", c.Key, c.Fence, err)
	}
	if res.unsure {
		return false, fmt.Errorf("datastorelock: complete %q fence %d: outcome unknown: a completion whose reply was lost "+
			"may have applied and expired before the record was found in other hands: %w", c.Key, c.Fence, res.lost)
	}
	return res.found && holds(res.rec, c) && res.rec.state == stateDone, nil
}

// Release implements store.Backend: one versioned update when the claim is
// unchanged. The lease is set to the server's time (its upper bound) when
// the update is sent, so the key is reclaimable once the update applies
// (give or take the latency of the request that brought the estimate).
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	_, err := b.change(ctx, c, func(cur record, now time.Time) (record, bool) {
		if !holds(cur, c) || cur.state != stateClaimed {
			return cur, false
		}
		cur.fence++
		cur.lease, cur.exp = now, now.Add(b.ttl)
		return cur, true
	})
	if err != nil {
		return fmt.Errorf("datastorelock: release %q fence %d: %w", c.Key, c.Fence, err)
	}
	return nil
}

// Extend implements store.Extender: the lease runs for lease from the
// server's time (its upper bound) when the update was sent.
func (b *Backend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return c, err
	}
	lease = wholeMicros(lease)
	res, err := b.change(ctx, c, func(cur record, now time.Time) (record, bool) {
		if !holds(cur, c) || cur.state != stateClaimed {
			return cur, false
		}
		cur.lease = now.Add(lease)
		cur.exp = cur.lease.Add(b.ttl)
		return cur, true
	})
	if err != nil {
		return c, fmt.Errorf("datastorelock: extend %q fence %d: %w", c.Key, c.Fence, err)
	}
	if !res.wrote {
		return c, fmt.Errorf("datastorelock: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry, c.Rev = res.rec.lease, res.rec.version
	return c, nil
}

// purgeBatch is how many records one PurgeExpired round reads and deletes.
const purgeBatch = 500

// PurgeExpired implements store.Purger, for databases without a TTL policy
// on expires_at. It queries records whose expires_at has passed by the
// lower bound of the server's time, in batches of 500 (whole entities: a
// projection would not carry their versions), and deletes those whose
// expires_at is not after the query's read_time, each with a versioned
// delete, so a record that was reclaimed after the query read it is left
// alone. A client clock that runs fast cannot make it delete early.
func (b *Backend) PurgeExpired(ctx context.Context, limit int) (int, error) {
	total := 0
	for limit <= 0 || total < limit {
		lo, _, ok := b.times()
		if !ok {
			if err := b.probe(ctx); err != nil {
				return total, fmt.Errorf("datastorelock: purge: reading the server's time: %w", err)
			}
			if lo, _, ok = b.times(); !ok {
				return total, fmt.Errorf("datastorelock: purge: %w", errNoServerTime)
			}
		}
		batch := int32(purgeBatch)
		if limit > 0 && limit-total < purgeBatch {
			batch = int32(limit - total)
		}
		var (
			found  []*pb.EntityResult
			readAt time.Time
		)
		err := b.retry(ctx, func() error {
			sent := b.now()
			res, err := b.rpc.RunQuery(b.ctx(ctx), &pb.RunQueryRequest{
				ProjectId:   b.project,
				DatabaseId:  b.database,
				PartitionId: &pb.PartitionId{ProjectId: b.project, DatabaseId: b.database, NamespaceId: b.namespace},
				QueryType: &pb.RunQueryRequest_Query{Query: &pb.Query{
					Kind: []*pb.KindExpression{{Name: b.kind}},
					Filter: &pb.Filter{FilterType: &pb.Filter_PropertyFilter{PropertyFilter: &pb.PropertyFilter{
						Property: &pb.PropertyReference{Name: propExpiresAt},
						Op:       pb.PropertyFilter_LESS_THAN_OR_EQUAL,
						Value:    &pb.Value{ValueType: &pb.Value_TimestampValue{TimestampValue: timestamppb.New(lo)}},
					}}},
					Limit: wrapperspb.Int32(batch),
				}},
			})
			if err != nil {
				return err
			}
			rt := res.GetBatch().GetReadTime()
			b.observe(rt, sent, b.now(), true)
			readAt = time.Time{}
			if rt != nil && rt.IsValid() {
				readAt = rt.AsTime()
			}
			found = res.GetBatch().GetEntityResults()
			return nil
		})
		if err != nil {
			return total, fmt.Errorf("datastorelock: purge query: %w", err)
		}
		muts := make([]*pb.Mutation, 0, len(found))
		for _, r := range found {
			exp := r.GetEntity().GetProperties()[propExpiresAt].GetTimestampValue()
			if exp == nil || exp.AsTime().After(lo) || (!readAt.IsZero() && exp.AsTime().After(readAt)) {
				continue // not expired by the server's reckoning
			}
			muts = append(muts, &pb.Mutation{
				Operation:                 &pb.Mutation_Delete{Delete: r.GetEntity().GetKey()},
				ConflictDetectionStrategy: &pb.Mutation_BaseVersion{BaseVersion: r.GetVersion()},
			})
		}
		if len(muts) == 0 {
			return total, nil
		}
		var deleted int
		err = b.retry(ctx, func() error {
			sent := b.now()
			res, err := b.rpc.Commit(b.ctx(ctx), &pb.CommitRequest{
				ProjectId: b.project, DatabaseId: b.database,
				Mode: pb.CommitRequest_NON_TRANSACTIONAL, Mutations: muts,
			})
			if err != nil {
				return err
			}
			b.observe(commitTime(res), sent, b.now(), false)
			deleted = 0
			for _, mr := range res.MutationResults {
				if !mr.ConflictDetected {
					deleted++
				}
			}
			return nil
		})
		if err != nil {
			return total, fmt.Errorf("datastorelock: purge delete: %w", err)
		}
		total += deleted
		if len(found) < int(batch) || deleted == 0 {
			return total, nil
		}
	}
	return total, nil
}
