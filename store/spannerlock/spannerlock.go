// Package spannerlock is a store.Backend on Cloud Spanner (and the Spanner
// emulator), for teams that run on Spanner already or need one store
// across regions.
//
// # Connecting
//
// [New] takes a [*spanner.Client] the caller already has, with whatever
// credentials, session settings and interceptors its owner gave it: it
// sends nothing, and the Backend's Close leaves the client open. [Dial] is
// the one-liner: it opens a client for a database name
// (projects/P/instances/I/databases/D), which honours
// SPANNER_EMULATOR_HOST as the Spanner client does, and the Backend's
// Close closes it.
//
// # The record
//
// One row per key in the table "IdempotencyKeys" ([WithTable]);
// [Backend.Schema] returns its DDL and [Backend.EnsureSchema] creates it:
//
//	CREATE TABLE IdempotencyKeys (
//	  key          BYTES(1024) NOT NULL,  -- the key's bytes, verbatim
//	  state        INT64 NOT NULL,        -- 1 claimed, 2 done
//	  fence        INT64 NOT NULL,        -- the fencing token
//	  lease_expiry TIMESTAMP NOT NULL,    -- when the holder's lease ends
//	  expires_at   TIMESTAMP NOT NULL,    -- when the row may be deleted
//	  token        STRING(64) NOT NULL,   -- the winning Claim's token
//	  fingerprint  STRING(128),           -- the payload fingerprint of a Done row
//	) PRIMARY KEY (key),
//	  ROW DELETION POLICY (OLDER_THAN(expires_at, INTERVAL 0 DAY))
//
// The row deletion policy lets Spanner delete expired rows by itself, some
// time (up to about three days) after expires_at, never before. A table
// created without it gets it with
//
//	ALTER TABLE IdempotencyKeys
//	  ADD ROW DELETION POLICY (OLDER_THAN(expires_at, INTERVAL 0 DAY))
//
// (gcloud spanner databases ddl update DATABASE --instance=INSTANCE
// --ddl='...'); without one, call [Backend.PurgeExpired] now and then.
//
// # Clock
//
// Spanner's clock judges every lease and ttl, never the client's: Claim
// reads CURRENT_TIMESTAMP() in the same query that reads the row, judges
// the row by it, and bases the new lease on it (lease_expiry = that
// instant + lease, expires_at = lease_expiry + ttl); Complete, Release and
// Extend compute their instants inside their DML from CURRENT_TIMESTAMP().
// Instances whose clocks disagree therefore agree on every lease, and the
// LeaseExpiry a claim reports is exactly the one stored.
//
// # Round trips
//
// Each call is one read-write transaction whose first statement begins it
// inline, so, counted by a gRPC interceptor on the emulator
// (TestRPCsPerOperation pins the counts):
//
//   - Claim: 2 RPCs (ExecuteStreamingSql: the row and CURRENT_TIMESTAMP();
//     Commit: the insert or update mutation, or nothing). A fresh delivery
//     (Claim + Complete) costs 4.
//   - Complete, Release, Extend: 2 RPCs (ExecuteSql or ExecuteStreamingSql:
//     one DML statement guarded by key, fence, token and state, with THEN
//     RETURN where the call needs the row, as Complete and Extend do;
//     Commit). After a Commit answered NotFound or FailedPrecondition
//     naming the transaction, Claim, Complete and Extend add one strong
//     read (ExecuteStreamingSql) to settle it, and a Complete run that
//     matches nothing after a Commit that may have applied adds a query
//     of CURRENT_TIMESTAMP().
//   - PurgeExpired: 1 RPC (a single-use read-only query for expired keys)
//     plus, when it found some, 3 per batch of up to 1,000 (a query for
//     CURRENT_TIMESTAMP() that begins the transaction, a read of those
//     rows by key, a Commit deleting those still expired).
//   - Inspect, List: 1 RPC (ExecuteStreamingSql: a single-use strong
//     read-only query, with CURRENT_TIMESTAMP()).
//   - ForceRelease, Forget: 2 RPCs (ExecuteSql: one DML statement guarded
//     by key, fence, state and the token's version; Commit).
//   - CompleteTx: the body's own RPCs plus an ExecuteSql (the Done mark's
//     DML statement) and the Commit they share (TestCompleteTxRPCs): one
//     RPC fewer than the body's transaction followed by Complete.
//
// Contention adds round trips: Spanner aborts one of two transactions that
// touch the same row, and the client runs the loser again.
//
// # Retries
//
// The Spanner client reruns a transaction that Spanner aborted, and
// resends a Commit that failed with Unavailable. Beyond that, a call is
// run again after Unavailable, Aborted, ResourceExhausted, Internal or
// DeadlineExceeded ([WithRetries]); every run is a whole transaction that
// reads before it decides, so it is idempotent. A Commit whose reply was
// lost may have applied, whatever the error that reports it: the Spanner
// client resends a Commit after Unavailable, and the emulator answers the
// resent one with NotFound or FailedPrecondition once a newer transaction
// of the same session has begun, though the first one applied; and the
// client runs the transaction again after Internal (which a connection
// broken mid-reply can give) as after Aborted, without saying which. So
// every failed Commit but a refusal (Aborted, AlreadyExists,
// InvalidArgument, PermissionDenied, Unauthenticated) may have applied,
// and so, to Claim and Complete, may every run the client starts again
// after a Commit. The same NotFound or FailedPrecondition is also how the
// emulator answers, with no reply lost, a Commit of a transaction it
// forgot because a concurrent one began (nothing applied): Claim,
// Complete and Extend tell the two apart at once, with a strong read of
// the row right after that answer. Claim writes its token into the row:
// a read that finds it answers Won with it. Complete's statement returns
// the expires-at instant it stored: a read that finds the row Done with
// the claim's fence and token answers true. Extend's returns the lease
// expiry it stored: a read that finds it in the row returns it; one that
// does not runs Extend again. Otherwise a run that finds the row in other
// hands rules an unknown write out when it reads before that write's
// lease would have lapsed (Claim) or before its expires-at instant
// (Complete: had it applied, the row would be Done with the claim's
// fence and token until then), or, for Claim, before the write's
// expires-at instant, finds no row or a fence no higher than the one it
// wrote (had it applied, the claim that took the key over would have
// raised the fence); a write once ruled out stays so. Otherwise Claim
// cannot tell whether it won and returns an error, never HeldByOther or
// AlreadyDone, and Complete returns an error instead of false. Complete
// and Release match key, fence and token, so a repeat changes nothing
// twice. Extend is not run again by the backend after a Commit that may
// have applied and that no read settled (another run would renew the
// lease a second time, from a later instant): it returns an error. (The
// Spanner client's own rerun after Aborted or Internal still runs it
// again.) With every reply delivered, no call answers that its outcome
// is unknown (TestHistoryOneDatabaseWithoutFaults: eight clients on two
// keys of one emulator database). A row deleted with Forget within the
// ttl of a completion is outside this reasoning.
//
// A lost reply to the statement that began a transaction inline leaves
// that transaction open on the server, unknown to the client, until
// Spanner ends it for idleness (about 10 seconds): calls on the same key
// wait for it meanwhile.
//
// # The emulator
//
// The Spanner emulator runs one read-write transaction at a time per
// database and aborts or forgets the others (Aborted, or NotFound and
// FailedPrecondition naming the transaction). The backend runs a call
// whose transaction was lost so again, up to 100 times within its context,
// without counting it against [WithRetries]. Concurrent calls on one
// emulator database therefore run one after another.
package spannerlock

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sync"
	"time"

	"cloud.google.com/go/spanner"
	"google.golang.org/api/option"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// DefaultTable is the table records are stored in.
const DefaultTable = "IdempotencyKeys"

const (
	stateClaimed = 1
	stateDone    = 2
)

// Option configures a Backend built by [New] or [Dial].
type Option func(*Backend)

// WithTable sets the table; the default is [DefaultTable]. The name must
// be a Spanner identifier (a letter, then letters, digits or underscores).
func WithTable(name string) Option { return func(b *Backend) { b.table = name } }

// WithTTL sets how long a completed key suppresses duplicates, and how long
// a claimed record outlives its lease. Default [store.DefaultTTL]. Any
// positive ttl is honoured, rounded up to a whole microsecond, and so is
// any positive lease: neither wraps, and math.MaxInt64 for both (a record
// that expires about 584 years from now) is well within Spanner's
// TIMESTAMP, which ends with the year 9999.
func WithTTL(ttl time.Duration) Option { return func(b *Backend) { b.ttl = ttl } }

// WithRetries sets how many times a call runs its transaction again after
// it failed with Unavailable, Aborted, ResourceExhausted, Internal or
// DeadlineExceeded, within the call's context, with jittered exponential
// waits between (10ms doubling up to 640ms). Default 5; 0 never retries
// (the Spanner client's own reruns of aborted transactions still happen).
func WithRetries(n int) Option { return func(b *Backend) { b.policy.Retries = n } }

// WithClientOptions passes options to the client that [Dial] opens
// (credentials, an endpoint, gRPC dial options); they come after the
// emulator's when SPANNER_EMULATOR_HOST is set, so they override them.
// [New] does not dial, and refuses this option.
func WithClientOptions(opts ...option.ClientOption) Option {
	return func(b *Backend) {
		b.clientOpts = append(b.clientOpts, opts...)
		b.clientOptsSet = true
	}
}

// Retry waits: the first after 10ms, doubling up to 640ms, each jittered
// into [d/2, d].
const (
	retryBase = 10 * time.Millisecond
	retryMax  = 640 * time.Millisecond
)

// Backend is a store.Backend on Cloud Spanner. It is safe for concurrent
// use by goroutines and processes. Build it with [New] or [Dial].
type Backend struct {
	client *spanner.Client
	owned  bool // Dial opened client; Close closes it
	table  string
	ttl    time.Duration
	policy retry.Policy

	clientOpts    []option.ClientOption
	clientOptsSet bool

	// emulator: SPANNER_EMULATOR_HOST was set when the Backend was
	// built, so its client talks to the emulator, which runs one
	// read-write transaction at a time per database.
	emulator bool
	// inTx holds, for each claim whose CompleteTx is running (on the
	// emulator only), a channel closed when it returns.
	inTxMu sync.Mutex
	inTx   map[txClaim]*txGate
}

var (
	_ store.Backend  = (*Backend)(nil)
	_ store.Extender = (*Backend)(nil)
	_ store.Purger   = (*Backend)(nil)

	_ store.Fingerprinter = (*Backend)(nil)
)

// Errors of the constructors, for errors.Is in this package's tests.
var (
	errNilClient     = errors.New("spannerlock: nil Spanner client")
	errNoDatabase    = errors.New("spannerlock: no database name")
	errClientOptions = errors.New("spannerlock: WithClientOptions configures the client Dial opens; New does not dial")
)

var identifier = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9_]{0,127}$`)

// New builds a Backend on client, a Spanner client for the database that
// holds (or will hold) the table. It sends nothing, and the Backend's Close
// leaves client open for its owner. It fails on a nil client, an invalid
// option, and on [WithClientOptions], which only [Dial] can honour.
func New(client *spanner.Client, opts ...Option) (*Backend, error) {
	if client == nil {
		return nil, errNilClient
	}
	b, err := configure(opts)
	if err != nil {
		return nil, err
	}
	if b.clientOptsSet {
		return nil, fmt.Errorf("%w: configure the client you pass to New instead", errClientOptions)
	}
	b.client = client
	return b, nil
}

// Dial opens a Spanner client for database
// (projects/P/instances/I/databases/D) and builds a Backend on it, which
// the Backend owns: its Close closes it. When SPANNER_EMULATOR_HOST is set
// the client talks to that emulator without credentials (the Spanner
// client's own rule); otherwise to Spanner with Application Default
// Credentials. [WithClientOptions] adds to those.
func Dial(ctx context.Context, database string, opts ...Option) (*Backend, error) {
	if database == "" {
		return nil, errNoDatabase
	}
	b, err := configure(opts)
	if err != nil {
		return nil, err
	}
	c, err := spanner.NewClientWithConfig(ctx, database, spanner.ClientConfig{DisableNativeMetrics: true}, b.clientOpts...)
	if err != nil {
		return nil, fmt.Errorf("spannerlock: opening a client for %s: %w", database, err)
	}
	b.client, b.owned = c, true
	return b, nil
}

// configure applies opts and checks the result.
func configure(opts []Option) (*Backend, error) {
	b := &Backend{table: DefaultTable, ttl: store.DefaultTTL, policy: retry.Policy{Retries: 5}}
	for _, o := range opts {
		o(b)
	}
	if err := store.ValidateTTL(b.ttl); err != nil {
		return nil, fmt.Errorf("spannerlock: %w", err)
	}
	if !identifier.MatchString(b.table) {
		return nil, fmt.Errorf("spannerlock: invalid table name %q", b.table)
	}
	if b.policy.Retries < 0 {
		return nil, fmt.Errorf("spannerlock: retries %d is negative", b.policy.Retries)
	}
	b.policy.Base, b.policy.Max = retryBase, retryMax
	b.emulator = os.Getenv("SPANNER_EMULATOR_HOST") != ""
	return b, nil
}

// Close closes the client that [Dial] opened. A Backend from [New] owns no
// client: its Close leaves the caller's open. Make it the Backend's last
// call.
func (b *Backend) Close() error {
	if b.owned {
		b.client.Close()
	}
	return nil
}

// TTL returns the ttl the backend applies, as configured; instants are
// computed with it rounded up to a whole microsecond.
func (b *Backend) TTL() time.Duration { return b.ttl }

// Table returns the name of the backend's table.
func (b *Backend) Table() string { return b.table }

// micros is d in whole microseconds, rounded up (the precision of
// CURRENT_TIMESTAMP() and of the INTERVAL arithmetic the DML uses),
// without overflow: store.CeilUnits.
func micros(d time.Duration) int64 { return store.CeilUnits(d, time.Microsecond) }
