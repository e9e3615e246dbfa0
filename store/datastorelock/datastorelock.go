// Package datastorelock is a store.Backend on Firestore in Datastore mode
// (and the Datastore emulator), the production default for Cloud Run.
//
// # Connecting
//
// [Dial] is the one-liner: it reads the project from the environment when
// none is given, dials the emulator named by DATASTORE_EMULATOR_HOST
// without credentials, or else datastore.googleapis.com with Application
// Default Credentials ([WithClientOptions] adjusts the dial), and the
// Backend's Close closes that connection.
//
// [New] takes a gRPC connection the caller already has, as redislock takes
// a Redis client and sqllock a *sql.DB: it never dials, it needs the
// project spelled out, and the Backend's Close leaves the connection open
// for its owner to close.
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
//	fingerprint   string     the payload fingerprint      not indexed, only on a Done record
//	                         CompleteFingerprint stored   that has one
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
//     millisecond or so). When the two bounds lie more than 100ms apart
//     (every recent reply was slow), the call reads first and bases its
//     write on that read instead. When the commit's own timestamp shows that the
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
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	pb "cloud.google.com/go/datastore/apiv1/datastorepb"
	"google.golang.org/api/option"
	gtransport "google.golang.org/api/transport/grpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
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
	propFP        = "fingerprint"
)

// Option configures a Backend built by [New] or [Dial].
type Option func(*Backend)

// WithDatabase selects a named database; the default is "(default)".
func WithDatabase(id string) Option { return func(b *Backend) { b.database = id } }

// WithNamespace stores records in a namespace.
func WithNamespace(ns string) Option { return func(b *Backend) { b.namespace = ns } }

// WithKind sets the entity kind; the default is [DefaultKind].
func WithKind(kind string) Option { return func(b *Backend) { b.kind = kind } }

// WithTTL sets how long a completed key suppresses duplicates, and how long
// a claimed record outlives its lease. Default [store.DefaultTTL]. Any
// positive ttl is honoured, rounded up to a whole microsecond, and so is
// any positive lease: instants are computed with [store.Instant], capped at
// [store.MaxInstant] (Datastore's timestamps end with the year 9999), never
// wrapped; math.MaxInt64 for both (a record that expires about 584 years
// from now) is well within it.
func WithTTL(ttl time.Duration) Option { return func(b *Backend) { b.ttl = ttl } }

// WithClientOptions passes options to the gRPC transport that [Dial] opens
// (credentials, an endpoint, dial options); they come after Dial's own, so
// they override them. [New] does not dial, and refuses this option.
func WithClientOptions(opts ...option.ClientOption) Option {
	return func(b *Backend) {
		b.clientOpts = append(b.clientOpts, opts...)
		b.clientOptsSet = true
	}
}

// WithClock makes the backend read the client's time from now instead of
// time.Now, for tests. It also measures the time elapsed since a server
// timestamp arrived (time.Now's monotonic reading makes that immune to
// steps of the wall clock).
func WithClock(now func() time.Time) Option { return func(b *Backend) { b.now = now } }

// WithRetries sets how many times an RPC is sent again after it failed
// with Unavailable, Aborted, ResourceExhausted, Internal or
// DeadlineExceeded, within the call's context, with jittered exponential
// waits between (10ms doubling up to 640ms). Default 5; 0 never retries.
func WithRetries(n int) Option { return func(b *Backend) { b.policy.Retries = n } }

// Retry waits: the first after 10ms, doubling up to 640ms, each jittered
// into [d/2, d].
const (
	retryBase = 10 * time.Millisecond
	retryMax  = 640 * time.Millisecond
)

// Backend is a store.Backend on Firestore in Datastore mode. It is safe for
// concurrent use. Build it with [New] on a connection you have, or with
// [Dial]; Close it when done.
type Backend struct {
	project, database, namespace, kind string
	ttl                                time.Duration
	policy                             retry.Policy // Retries from WithRetries
	now                                func() time.Time

	// WithClientOptions, for Dial; set records that it was given.
	clientOpts    []option.ClientOption
	clientOptsSet bool

	rpc    pb.DatastoreClient
	conn   grpc.ClientConnInterface
	closer io.Closer // the connection Dial opened; nil from New
	tx     txClient  // CompleteTx's datastore client (tx.go)
	md     metadata.MD

	clock *doclock.Clock
	lk    *doclock.Lock
}

var (
	_ store.Backend       = (*Backend)(nil)
	_ store.Extender      = (*Backend)(nil)
	_ store.Purger        = (*Backend)(nil)
	_ store.Fingerprinter = (*Backend)(nil)
)

// New builds a Backend for project on conn, an existing gRPC connection
// to Datastore (or to the emulator) with whatever credentials and
// interceptors its owner gave it; for example a [*grpc.ClientConn], or the
// pool that google.golang.org/api/transport/grpc's DialPool returns. New
// never dials and sends nothing, and the Backend's Close leaves conn open:
// conn's owner closes it after the Backend's last call. Several Backends
// (other kinds, namespaces or databases) may share one conn.
//
// The project is required: New reads nothing from the environment, as a
// caller who built the connection knows which project it serves (use
// [Dial] for the defaults from the environment). New fails on a nil conn,
// an empty project, an invalid option, and on [WithClientOptions], which
// only a dial can honour.
func New(conn grpc.ClientConnInterface, project string, opts ...Option) (*Backend, error) {
	if err := doclock.CheckNew("datastorelock", conn, project, false); err != nil {
		return nil, err
	}
	b, err := configure(project, opts)
	if err != nil {
		return nil, err
	}
	if err := doclock.CheckNew("datastorelock", conn, project, b.clientOptsSet); err != nil {
		return nil, err
	}
	b.attach(conn, nil)
	return b, nil
}

// Dial connects to Datastore and builds a Backend for project on that
// connection, which the Backend owns: its Close closes it. An empty
// project is read from DATASTORE_PROJECT_ID, then GOOGLE_CLOUD_PROJECT.
// When DATASTORE_EMULATOR_HOST is set it dials that emulator without
// credentials, as the official client does; otherwise it dials
// datastore.googleapis.com:443 with Application Default Credentials.
// [WithClientOptions] adds to (and overrides) those dial options.
func Dial(ctx context.Context, project string, opts ...Option) (*Backend, error) {
	if project == "" {
		project = os.Getenv("DATASTORE_PROJECT_ID")
	}
	if project == "" {
		project = os.Getenv("GOOGLE_CLOUD_PROJECT")
	}
	if project == "" {
		return nil, fmt.Errorf("datastorelock: %w (pass one, or set DATASTORE_PROJECT_ID or GOOGLE_CLOUD_PROJECT)", doclock.ErrNoProject)
	}
	b, err := configure(project, opts)
	if err != nil {
		return nil, err
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
	b.attach(conn, conn)
	return b, nil
}

// configure applies opts to a Backend for project and checks the result.
func configure(project string, opts []Option) (*Backend, error) {
	b := &Backend{project: project, kind: DefaultKind, ttl: store.DefaultTTL, policy: retry.Policy{Retries: 5}, now: time.Now}
	for _, o := range opts {
		o(b)
	}
	if err := store.ValidateTTL(b.ttl); err != nil {
		return nil, fmt.Errorf("datastorelock: %w", err)
	}
	if b.kind == "" || strings.HasPrefix(b.kind, "__") {
		return nil, fmt.Errorf("datastorelock: invalid kind %q", b.kind)
	}
	if b.policy.Retries < 0 {
		return nil, fmt.Errorf("datastorelock: retries %d is negative", b.policy.Retries)
	}
	b.policy.Base, b.policy.Max = retryBase, retryMax
	b.clock = doclock.NewClock(b.now)
	b.lk = doclock.New("datastorelock", b.ttl, b.clock, requests{b})
	return b, nil
}

// attach makes b send its RPCs on conn, and close owned (nil when the
// caller owns conn) when b is closed.
func (b *Backend) attach(conn grpc.ClientConnInterface, owned io.Closer) {
	b.rpc = pb.NewDatastoreClient(conn)
	b.conn = conn
	b.closer = owned
	prefix := "projects/" + b.project
	params := "project_id=" + b.project
	if b.database != "" {
		prefix += "/databases/" + b.database
		params += "&database_id=" + b.database
	}
	b.md = metadata.Pairs("google-cloud-resource-prefix", prefix, "x-goog-request-params", params)
}

// Close closes the connection that [Dial] opened. A Backend from [New]
// owns no connection: its Close returns nil and leaves the caller's
// connection open. Close does not wait for calls in flight; make it the
// Backend's last call.
func (b *Backend) Close() error {
	if b.closer == nil {
		return nil
	}
	return b.closer.Close()
}

// TTL returns the ttl the backend applies.
func (b *Backend) TTL() time.Duration { return b.ttl }

func (b *Backend) ctx(ctx context.Context) context.Context {
	return metadata.NewOutgoingContext(ctx, b.md)
}

func (b *Backend) dsKey(key string) *pb.Key {
	return &pb.Key{
		PartitionId: &pb.PartitionId{ProjectId: b.project, DatabaseId: b.database, NamespaceId: b.namespace},
		Path:        []*pb.Key_PathElement{{Kind: b.kind, IdType: &pb.Key_PathElement_Name{Name: Name(key)}}},
	}
}

// entity encodes record r of key. The fingerprint property is written
// only when r has one: a record without it decodes as having none.
func (b *Backend) entity(key string, r doclock.Record) *pb.Entity {
	ts := func(t time.Time) *pb.Value {
		return &pb.Value{ValueType: &pb.Value_TimestampValue{TimestampValue: timestamppb.New(t)}, ExcludeFromIndexes: true}
	}
	exp := ts(r.Exp)
	exp.ExcludeFromIndexes = false
	e := &pb.Entity{
		Key: b.dsKey(key),
		Properties: map[string]*pb.Value{
			propState:     {ValueType: &pb.Value_IntegerValue{IntegerValue: r.State}, ExcludeFromIndexes: true},
			propFence:     {ValueType: &pb.Value_IntegerValue{IntegerValue: r.Fence}, ExcludeFromIndexes: true},
			propLease:     ts(r.Lease),
			propExpiresAt: exp,
			propToken:     {ValueType: &pb.Value_StringValue{StringValue: r.Token}, ExcludeFromIndexes: true},
		},
	}
	if r.Fingerprint != "" {
		e.Properties[propFP] = &pb.Value{ValueType: &pb.Value_StringValue{StringValue: r.Fingerprint}, ExcludeFromIndexes: true}
	}
	return e
}

func decode(res *pb.EntityResult) (doclock.Record, error) {
	p := res.GetEntity().GetProperties()
	r := doclock.Record{
		State:       p[propState].GetIntegerValue(),
		Fence:       p[propFence].GetIntegerValue(),
		Lease:       p[propLease].GetTimestampValue().AsTime(),
		Exp:         p[propExpiresAt].GetTimestampValue().AsTime(),
		Token:       p[propToken].GetStringValue(),
		Fingerprint: p[propFP].GetStringValue(),
		Version:     res.GetVersion(),
	}
	if (r.State != doclock.StateClaimed && r.State != doclock.StateDone) || r.Fence < 1 {
		return r, fmt.Errorf("datastorelock: entity %v is not a record of this backend (state %d, fence %d)",
			res.GetEntity().GetKey(), r.State, r.Fence)
	}
	return r, nil
}
