// Package firestorelock is a store.Backend on Firestore in Native mode
// (and the Firestore emulator): the backend for Google Cloud projects whose
// default database is a Native-mode one, which does not serve the
// Datastore API that datastorelock speaks.
//
// # Connecting
//
// [Dial] is the one-liner: it dials the emulator named by
// FIRESTORE_EMULATOR_HOST without credentials, or else
// firestore.googleapis.com with Application Default Credentials
// ([WithClientOptions] adjusts the dial); an empty project is read from
// GOOGLE_CLOUD_PROJECT (then GCLOUD_PROJECT); the Backend's Close closes
// the connection it dialled.
//
// [New] takes a gRPC connection the caller already has (with its
// credentials and interceptors): it never dials, it needs the project
// spelled out, and the Backend's Close leaves the connection open for its
// owner to close.
//
// # Two RPCs per delivery
//
// The backend speaks the Firestore v1 gRPC API (firestorepb) directly,
// because the high-level cloud.google.com/go/firestore client reports a
// write's update time but not its commit time apart from it, and the
// backend needs both: the update time of a document is its version, which
// preconditions compare, and the commit time and read time are the
// server's clock, which judges leases. Preconditions make transactions
// unnecessary:
//
//   - Claim on a fresh key is one Commit of a write with the precondition
//     exists=false: it creates the record, or fails with AlreadyExists.
//   - Claim on an existing key is a BatchGetDocuments read and, when the
//     record is reclaimable, one write preconditioned on the update time
//     that read saw: 2 or 3 RPCs in all. A concurrent writer makes the
//     write fail with FailedPrecondition instead of applying; the claim
//     then reads again.
//   - Complete, Release and Extend are one write preconditioned on the
//     update time the claim left (carried in store.Claim.Rev as Unix
//     nanoseconds), so a record that anyone changed since is never
//     overwritten; on a conflict a read decides, and only a record whose
//     fence and token both match the claim's is changed.
//
// So a delivery to a fresh key costs 2 RPCs (create, then the
// preconditioned completion), a duplicate 2 (the refused create and a
// read), and the first Claim of a Backend (or one after an idle minute) one
// more read for the server's time.
//
// # The record
//
// One document per key in the collection "idempotency_keys"
// (WithCollection) of the database "(default)" (WithDatabase), whose ID is
// the key itself, or "~" + base64url(key) for a key that is not valid
// UTF-8, that contains "/", that starts with "~", that is "." or "..", or
// that Firestore reserves (__.*__) (see [Name]): the mapping is one-to-one,
// and a 1024-byte key still fits Firestore's 1500-byte ID limit.
//
//	state         integer    1 claimed, 2 done
//	fence         integer    the fencing token
//	lease_expiry  timestamp  when the holder's lease ends
//	expires_at    timestamp  when the record may go (PurgeExpired, TTL policy)
//	token         string     the winning Claim's token
//	fingerprint   string     the payload fingerprint that CompleteFingerprint
//	                         stored (only on a Done record that has one)
//
// Of the fields, only expires_at is queried (by PurgeExpired; List queries
// document names, which the built-in index serves). A TTL policy on it lets
// Firestore delete expired records by itself (typically within a day
// after expires_at, never before):
//
//	gcloud firestore fields ttls update expires_at \
//	    --collection-group=idempotency_keys --enable-ttl
//
// Without one, call PurgeExpired now and then. The other fields need no
// index; single-field index exemptions for them save write cost:
//
//	gcloud firestore indexes fields update state --collection-group=idempotency_keys --disable-indexes
//
// (and likewise for fence, lease_expiry, token and fingerprint).
//
// # Clock
//
// Leases and ttls are judged by Firestore's clock, so that an instance
// whose clock runs fast cannot take a live lease or end a ttl early, and
// one whose clock runs slow cannot store a lease that has lapsed already:
//
//   - A read (BatchGetDocuments) judges the record it read by the reply's
//     read_time.
//   - A write that follows a read in the same call (a reclaim; a create
//     after a read found the key absent; Complete, Release or Extend after
//     a conflict or a stale estimate) bases its instants on that read's
//     read_time carried forward by the time elapsed since its reply
//     arrived: an instant between the read and the server's now.
//   - Any other write (the create of a fresh key; Complete, Release and
//     Extend on their first try) bases them on an estimate that is never
//     earlier than the server's time when the request is sent: a server
//     timestamp seen (a read's read_time or a Commit's commit_time) plus
//     the time elapsed on this process's monotonic clock since the request
//     that brought it was sent, the least such bound of the last minute (it
//     runs ahead of the server's time by the one-way latency of the fastest
//     recent request, a millisecond or so, more on a loaded network).
//     When the two bounds lie more than 100ms apart (every recent reply
//     was slow), the call reads first and bases its write on that read
//     instead.
//     When the commit_time shows that the estimate ran ahead of it by more
//     than 100ms, the call reports an unknown outcome (an error) rather
//     than instants outside its span.
//   - Either way a lease runs for at least its length from a server instant
//     within the Claim call, and the LeaseExpiry a claim reports is exactly
//     the one stored; a Done record's ttl runs from an instant within the
//     Complete call.
//   - An estimate older than a minute is not trusted: Claim then reads
//     before it writes, as do Complete, Release, Extend and PurgeExpired,
//     which costs one RPC after an idle minute (and on a Backend's first
//     Claim).
//   - PurgeExpired queries records expired by the lower bound of the
//     server's time and deletes only those whose expires_at is not after
//     the query's read_time, each preconditioned on the update time the
//     query saw.
//
// Firestore and its emulator always report read_time and commit_time. The
// client's clock is only a fallback for a service whose first read reply
// carries no read_time: the Backend then judges by it, and instances whose
// clocks disagree by s shift each other's view of a lease by s.
//
// # Retries
//
// Every RPC is retried after Unavailable, Aborted, ResourceExhausted,
// Internal or DeadlineExceeded (WithRetries). A retried write may have
// applied although its reply was lost; the token of the Claim call tells
// its own write apart (a resent create that finds a record with its own
// token has won), and a Claim that finds it answers Won with it. When a
// retry finds the record in other hands (or gone) at a time when, had the
// lost write applied, others could already have taken the key from it,
// Claim cannot tell whether it won and returns an error, never HeldByOther
// or AlreadyDone; Complete does the same. Complete, Release and Extend
// recognise their own lost write and do not apply it twice.
package firestorelock

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	pb "cloud.google.com/go/firestore/apiv1/firestorepb"
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

// DefaultCollection is the collection records are stored in.
const DefaultCollection = "idempotency_keys"

// DefaultDatabase is the database records are stored in.
const DefaultDatabase = "(default)"

// Field names of a record.
const (
	fieldState     = "state"
	fieldFence     = "fence"
	fieldLease     = "lease_expiry"
	fieldExpiresAt = "expires_at"
	fieldToken     = "token"
	fieldFP        = "fingerprint"
)

// Option configures a Backend built by [New] or [Dial].
type Option func(*Backend)

// WithDatabase selects a named database; the default is [DefaultDatabase].
func WithDatabase(id string) Option { return func(b *Backend) { b.database = id } }

// WithCollection sets the collection records are stored in; the default
// is [DefaultCollection]. A TTL policy names it as its collection group.
func WithCollection(id string) Option { return func(b *Backend) { b.collection = id } }

// WithTTL sets how long a completed key suppresses duplicates, and how long
// a claimed record outlives its lease. Default [store.DefaultTTL]. Any
// positive ttl is honoured, rounded up to a whole microsecond, and so is
// any positive lease: instants are computed with [store.Instant], capped at
// [store.MaxInstant] (Firestore's timestamps end with the year 9999), never
// wrapped; math.MaxInt64 for both (a record that expires about 584 years
// from now) is well within it.
func WithTTL(ttl time.Duration) Option { return func(b *Backend) { b.ttl = ttl } }

// WithRetries sets how many times an RPC is sent again after it failed
// with Unavailable, Aborted, ResourceExhausted, Internal or
// DeadlineExceeded, within the call's context, with jittered exponential
// waits between (10ms doubling up to 640ms). Default 5; 0 never retries.
func WithRetries(n int) Option { return func(b *Backend) { b.policy.Retries = n } }

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
// time.Now, for tests. The client's clock measures the time elapsed since
// a server timestamp arrived (time.Now's monotonic reading makes that
// immune to steps of the wall clock), and judges leases only for a service
// that reports no time.
func WithClock(now func() time.Time) Option { return func(b *Backend) { b.now = now } }

// Retry waits: the first after 10ms, doubling up to 640ms, each jittered
// into [d/2, d].
const (
	retryBase = 10 * time.Millisecond
	retryMax  = 640 * time.Millisecond
)

// Backend is a store.Backend on Firestore in Native mode. It is safe for
// concurrent use. Build it with [New] on a connection you have, or with
// [Dial]; Close it when done.
type Backend struct {
	project, database, collection string
	ttl                           time.Duration
	policy                        retry.Policy // Retries from WithRetries
	now                           func() time.Time

	// WithClientOptions, for Dial; set records that it was given.
	clientOpts    []option.ClientOption
	clientOptsSet bool

	rpc    pb.FirestoreClient
	conn   grpc.ClientConnInterface
	closer io.Closer // the connection Dial opened; nil from New
	tx     txClient  // CompleteTx's firestore client (tx.go)
	md     metadata.MD
	db     string // projects/P/databases/D
	docs   string // db + "/documents/" + collection + "/"

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
// to Firestore (or to the emulator) with whatever credentials and
// interceptors its owner gave it; for example a [*grpc.ClientConn], or the
// pool that google.golang.org/api/transport/grpc's DialPool returns. New
// never dials and sends nothing, and the Backend's Close leaves conn open:
// conn's owner closes it after the Backend's last call. Several Backends
// (other collections or databases) may share one conn.
//
// The project is required: New reads nothing from the environment (use
// [Dial] for the defaults from the environment). New fails on a nil conn,
// an empty project, an invalid option, and on [WithClientOptions], which
// only a dial can honour.
func New(conn grpc.ClientConnInterface, project string, opts ...Option) (*Backend, error) {
	if err := doclock.CheckNew("firestorelock", conn, project, false); err != nil {
		return nil, err
	}
	b, err := configure(project, opts)
	if err != nil {
		return nil, err
	}
	if err := doclock.CheckNew("firestorelock", conn, project, b.clientOptsSet); err != nil {
		return nil, err
	}
	b.attach(conn, nil)
	return b, nil
}

// Dial connects to Firestore and builds a Backend for project on that
// connection, which the Backend owns: its Close closes it. An empty
// project is read from GOOGLE_CLOUD_PROJECT, then GCLOUD_PROJECT. When
// FIRESTORE_EMULATOR_HOST is set it dials that emulator without
// credentials, as the official client does; otherwise it dials
// firestore.googleapis.com:443 with Application Default Credentials.
// [WithClientOptions] adds to (and overrides) those dial options.
func Dial(ctx context.Context, project string, opts ...Option) (*Backend, error) {
	for _, env := range []string{"GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT"} {
		if project == "" {
			project = os.Getenv(env)
		}
	}
	if project == "" {
		return nil, fmt.Errorf("firestorelock: %w (pass one, or set GOOGLE_CLOUD_PROJECT)", doclock.ErrNoProject)
	}
	b, err := configure(project, opts)
	if err != nil {
		return nil, err
	}
	var dial []option.ClientOption
	if addr := os.Getenv("FIRESTORE_EMULATOR_HOST"); addr != "" {
		addr = strings.TrimPrefix(strings.TrimPrefix(addr, "http://"), "https://")
		dial = []option.ClientOption{
			option.WithEndpoint("passthrough:///" + addr),
			option.WithoutAuthentication(),
			option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())),
		}
	} else {
		dial = []option.ClientOption{
			option.WithEndpoint("firestore.googleapis.com:443"),
			option.WithScopes("https://www.googleapis.com/auth/datastore"),
		}
	}
	conn, err := gtransport.DialPool(ctx, append(dial, b.clientOpts...)...)
	if err != nil {
		return nil, fmt.Errorf("firestorelock: dialing: %w", err)
	}
	b.attach(conn, conn)
	return b, nil
}

// configure applies opts to a Backend for project and checks the result.
func configure(project string, opts []Option) (*Backend, error) {
	b := &Backend{
		project: project, database: DefaultDatabase, collection: DefaultCollection,
		ttl: store.DefaultTTL, policy: retry.Policy{Retries: 5}, now: time.Now,
	}
	for _, o := range opts {
		o(b)
	}
	if err := store.ValidateTTL(b.ttl); err != nil {
		return nil, fmt.Errorf("firestorelock: %w", err)
	}
	if c := b.collection; c == "" || strings.Contains(c, "/") || c == "." || c == ".." ||
		(strings.HasPrefix(c, "__") && strings.HasSuffix(c, "__")) || len(c) > 1500 {
		return nil, fmt.Errorf("firestorelock: invalid collection ID %q", c)
	}
	if b.database == "" || strings.Contains(b.database, "/") {
		return nil, fmt.Errorf("firestorelock: invalid database ID %q", b.database)
	}
	if b.policy.Retries < 0 {
		return nil, fmt.Errorf("firestorelock: retries %d is negative", b.policy.Retries)
	}
	b.policy.Base, b.policy.Max = retryBase, retryMax
	b.clock = doclock.NewClock(b.now)
	b.lk = doclock.New("firestorelock", b.ttl, b.clock, requests{b})
	return b, nil
}

// attach makes b send its RPCs on conn, and close owned (nil when the
// caller owns conn) when b is closed.
func (b *Backend) attach(conn grpc.ClientConnInterface, owned io.Closer) {
	b.rpc = pb.NewFirestoreClient(conn)
	b.conn = conn
	b.closer = owned
	b.db = "projects/" + b.project + "/databases/" + b.database
	b.docs = b.db + "/documents/" + b.collection + "/"
	b.md = metadata.Pairs("google-cloud-resource-prefix", b.db, "x-goog-request-params", "database="+b.db)
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

// Collection returns the collection the backend stores records in.
func (b *Backend) Collection() string { return b.collection }

func (b *Backend) ctx(ctx context.Context) context.Context {
	return metadata.NewOutgoingContext(ctx, b.md)
}

// docName is the resource name of key's document.
func (b *Backend) docName(key string) string { return b.docs + Name(key) }

// document encodes record r of key. The fingerprint field is written only
// when r has one: a record without it decodes as having none.
func (b *Backend) document(key string, r doclock.Record) *pb.Document {
	ts := func(t time.Time) *pb.Value {
		return &pb.Value{ValueType: &pb.Value_TimestampValue{TimestampValue: timestamppb.New(t)}}
	}
	d := &pb.Document{
		Name: b.docName(key),
		Fields: map[string]*pb.Value{
			fieldState:     {ValueType: &pb.Value_IntegerValue{IntegerValue: r.State}},
			fieldFence:     {ValueType: &pb.Value_IntegerValue{IntegerValue: r.Fence}},
			fieldLease:     ts(r.Lease),
			fieldExpiresAt: ts(r.Exp),
			fieldToken:     {ValueType: &pb.Value_StringValue{StringValue: r.Token}},
		},
	}
	if r.Fingerprint != "" {
		d.Fields[fieldFP] = &pb.Value{ValueType: &pb.Value_StringValue{StringValue: r.Fingerprint}}
	}
	return d
}

// decode reads a document as a record; its Version is its update time
// (see rev).
func decode(d *pb.Document) (doclock.Record, error) {
	f := d.GetFields()
	r := doclock.Record{
		State:       f[fieldState].GetIntegerValue(),
		Fence:       f[fieldFence].GetIntegerValue(),
		Lease:       f[fieldLease].GetTimestampValue().AsTime(),
		Exp:         f[fieldExpiresAt].GetTimestampValue().AsTime(),
		Token:       f[fieldToken].GetStringValue(),
		Fingerprint: f[fieldFP].GetStringValue(),
		Version:     rev(d.GetUpdateTime().AsTime()),
	}
	if (r.State != doclock.StateClaimed && r.State != doclock.StateDone) || r.Fence < 1 || !d.GetUpdateTime().IsValid() {
		return r, fmt.Errorf("firestorelock: document %s is not a record of this backend (state %d, fence %d)",
			d.GetName(), r.State, r.Fence)
	}
	return r, nil
}

// rev encodes a record's version (its update time) for store.Claim.Rev:
// Unix nanoseconds, zero for unknown.
func rev(version time.Time) int64 {
	if version.IsZero() {
		return 0
	}
	return version.UnixNano()
}

// unrev decodes store.Claim.Rev.
func unrev(r int64) time.Time {
	if r == 0 {
		return time.Time{}
	}
	return time.Unix(0, r).UTC()
}
