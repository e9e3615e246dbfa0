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
// Datastore gives a client no server time to judge leases by, so the
// backend uses the client's clock. Instances whose clocks disagree by s
// shift each other's view of a lease by s: keep lease and ttl far above any
// plausible skew (Cloud Run instances are NTP-synchronized to well under a
// second; the defaults are 15 minutes and 1 hour).
package datastorelock

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"strings"
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

// WithClock makes the backend read time from now instead of time.Now, for
// tests.
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

// Name returns the entity name a key is stored under.
func Name(key string) string {
	if utf8.ValidString(key) && !strings.HasPrefix(key, "~") && !(strings.HasPrefix(key, "__") && strings.HasSuffix(key, "__")) {
		return key
	}
	return "~" + base64.RawURLEncoding.EncodeToString([]byte(key))
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

func (b *Backend) clock() time.Time { return b.now().UTC().Truncate(time.Microsecond) }

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

// lookup reads the record for key; found is false when it does not exist.
func (b *Backend) lookup(ctx context.Context, key string) (r record, found bool, err error) {
	err = b.retry(ctx, func() error {
		res, err := b.rpc.Lookup(b.ctx(ctx), &pb.LookupRequest{
			ProjectId:  b.project,
			DatabaseId: b.database,
			Keys:       []*pb.Key{b.dsKey(key)},
		})
		if err != nil {
			return err
		}
		if len(res.Found) == 0 {
			found = false
			return nil
		}
		r, err = decode(res.Found[0])
		found = err == nil
		return err
	})
	return r, found, err
}

// write commits one mutation outside any transaction and returns the
// entity's new version; applied is false when base_version conflicted.
// AlreadyExists (an insert of an existing key) is returned as is.
func (b *Backend) write(ctx context.Context, m *pb.Mutation) (version int64, applied bool, err error) {
	err = b.retry(ctx, func() error {
		res, err := b.rpc.Commit(b.ctx(ctx), &pb.CommitRequest{
			ProjectId:  b.project,
			DatabaseId: b.database,
			Mode:       pb.CommitRequest_NON_TRANSACTIONAL,
			Mutations:  []*pb.Mutation{m},
		})
		if err != nil {
			return err
		}
		if len(res.MutationResults) != 1 {
			return fmt.Errorf("commit returned %d mutation results, want 1", len(res.MutationResults))
		}
		mr := res.MutationResults[0]
		version, applied = mr.Version, !mr.ConflictDetected
		return nil
	})
	return version, applied, err
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
// lookup and, to reclaim, a versioned update (2 or 3 RPCs).
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
	token := store.NewToken()
	tryInsert := true
	for range maxRounds {
		now := b.clock()
		if tryInsert {
			rec := record{state: stateClaimed, fence: 1, lease: now.Add(lease), token: token}
			rec.exp = rec.lease.Add(b.ttl)
			v, _, err := b.write(ctx, insert(b.entity(key, rec)))
			if err == nil {
				return won(key, rec, v), nil
			}
			if status.Code(err) != codes.AlreadyExists {
				return store.Result{}, b.unknown(key, err)
			}
		}
		cur, found, err := b.lookup(ctx, key)
		if err != nil {
			return store.Result{}, b.unknown(key, err)
		}
		if !found { // deleted after it expired: start afresh
			tryInsert = true
			continue
		}
		now = b.clock()
		switch {
		case cur.token == token && cur.state == stateClaimed:
			// An earlier try of this call won; its reply was lost.
			return won(key, cur, cur.version), nil
		case cur.state == stateDone && now.Before(cur.exp):
			return store.Result{Outcome: store.AlreadyDone, Until: cur.exp}, nil
		case cur.state == stateClaimed && now.Before(cur.lease):
			return store.Result{Outcome: store.HeldByOther, Until: cur.lease}, nil
		}
		next := record{state: stateClaimed, fence: cur.fence + 1, lease: now.Add(lease), token: token}
		next.exp = next.lease.Add(b.ttl)
		v, applied, err := b.write(ctx, update(b.entity(key, next), cur.version))
		if err != nil {
			if status.Code(err) == codes.NotFound {
				tryInsert = true
				continue
			}
			return store.Result{}, b.unknown(key, err)
		}
		if applied {
			return won(key, next, v), nil
		}
		// Someone wrote the record since the lookup (or our own update
		// applied and its reply was lost): look again.
		tryInsert = false
	}
	return store.Result{}, fmt.Errorf("datastorelock: claim %q: still contended after %d rounds", key, maxRounds)
}

func won(key string, r record, version int64) store.Result {
	return store.Result{Outcome: store.Won, Claim: store.Claim{
		Key: key, Fence: r.fence, Token: r.token, LeaseExpiry: r.lease, Rev: version,
	}}
}

func (b *Backend) unknown(key string, err error) error {
	return fmt.Errorf("datastorelock: claim %q (outcome unknown: the key may be held until its lease lapses): %w", key, err)
}

// change applies f to the record of claim c with a versioned update. f sees
// the current record and says what to write, or stops with a result. Only
// the claim's fence entitles a change.
//
// When the claim carries the entity's version, the first round trusts the
// claim's own view of the record and skips the lookup: if the record
// changed since, the versioned update does not apply, and the next round
// reads it.
func (b *Backend) change(ctx context.Context, c store.Claim, f func(cur record) (next record, write bool)) (record, bool, error) {
	cur := fromClaim(c, b.ttl)
	known := c.Rev != 0
	for range maxRounds {
		if !known {
			r, found, err := b.lookup(ctx, c.Key)
			if err != nil {
				return record{}, false, err
			}
			if !found {
				return record{}, false, nil
			}
			cur, known = r, true
		}
		next, write := f(cur)
		if !write {
			return cur, false, nil
		}
		v, applied, err := b.write(ctx, update(b.entity(c.Key, next), cur.version))
		if status.Code(err) == codes.NotFound {
			return record{}, false, nil
		}
		if err != nil {
			return record{}, false, err
		}
		if applied {
			next.version = v
			return next, true, nil
		}
		known = false // changed under us: read it and decide again
	}
	return record{}, false, fmt.Errorf("still contended after %d rounds", maxRounds)
}

// fromClaim is what the record looks like while c holds it unchanged, for
// an update that knows the version but has not read the entity.
func fromClaim(c store.Claim, ttl time.Duration) record {
	return record{state: stateClaimed, fence: c.Fence, lease: c.LeaseExpiry, exp: c.LeaseExpiry.Add(ttl), token: c.Token, version: c.Rev}
}

// Complete implements store.Backend: one versioned update when the claim
// is unchanged.
func (b *Backend) Complete(ctx context.Context, c store.Claim) (bool, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return false, err
	}
	var done bool
	_, _, err := b.change(ctx, c, func(cur record) (record, bool) {
		if cur.fence != c.Fence || cur.state == stateDone {
			done = cur.fence == c.Fence
			return cur, false
		}
		cur.state, cur.exp = stateDone, b.clock().Add(b.ttl)
		done = true
		return cur, true
	})
	if err != nil {
		return false, fmt.Errorf("datastorelock: complete %q fence %d: %w", c.Key, c.Fence, err)
	}
	return done, nil
}

// Release implements store.Backend: one versioned update when the claim is
// unchanged.
func (b *Backend) Release(ctx context.Context, c store.Claim) error {
	if err := store.ValidateKey(c.Key); err != nil {
		return err
	}
	_, _, err := b.change(ctx, c, func(cur record) (record, bool) {
		if cur.fence != c.Fence || cur.state != stateClaimed {
			return cur, false
		}
		now := b.clock()
		cur.fence++
		cur.lease, cur.exp = now, now.Add(b.ttl)
		return cur, true
	})
	if err != nil {
		return fmt.Errorf("datastorelock: release %q fence %d: %w", c.Key, c.Fence, err)
	}
	return nil
}

// Extend implements store.Extender.
func (b *Backend) Extend(ctx context.Context, c store.Claim, lease time.Duration) (store.Claim, error) {
	if err := store.ValidateKey(c.Key); err != nil {
		return c, err
	}
	if err := store.ValidateLease(lease); err != nil {
		return c, err
	}
	next, ok, err := b.change(ctx, c, func(cur record) (record, bool) {
		if cur.fence != c.Fence || cur.state != stateClaimed {
			return cur, false
		}
		cur.lease = b.clock().Add(lease)
		cur.exp = cur.lease.Add(b.ttl)
		return cur, true
	})
	if err != nil {
		return c, fmt.Errorf("datastorelock: extend %q fence %d: %w", c.Key, c.Fence, err)
	}
	if !ok {
		return c, fmt.Errorf("datastorelock: extend %q fence %d: %w", c.Key, c.Fence, store.ErrLost)
	}
	c.LeaseExpiry, c.Rev = next.lease, next.version
	return c, nil
}

// purgeBatch is how many records one PurgeExpired round reads and deletes.
const purgeBatch = 500

// PurgeExpired implements store.Purger, for databases without a TTL policy
// on expires_at. It queries records past expires_at in batches of 500
// (whole entities: a projection would not carry their versions) and deletes
// each with a versioned delete, so a record that was reclaimed after the
// query read it is left alone.
func (b *Backend) PurgeExpired(ctx context.Context, limit int) (int, error) {
	total := 0
	for limit <= 0 || total < limit {
		batch := int32(purgeBatch)
		if limit > 0 && limit-total < purgeBatch {
			batch = int32(limit - total)
		}
		var found []*pb.EntityResult
		err := b.retry(ctx, func() error {
			res, err := b.rpc.RunQuery(b.ctx(ctx), &pb.RunQueryRequest{
				ProjectId:   b.project,
				DatabaseId:  b.database,
				PartitionId: &pb.PartitionId{ProjectId: b.project, DatabaseId: b.database, NamespaceId: b.namespace},
				QueryType: &pb.RunQueryRequest_Query{Query: &pb.Query{
					Kind: []*pb.KindExpression{{Name: b.kind}},
					Filter: &pb.Filter{FilterType: &pb.Filter_PropertyFilter{PropertyFilter: &pb.PropertyFilter{
						Property: &pb.PropertyReference{Name: propExpiresAt},
						Op:       pb.PropertyFilter_LESS_THAN_OR_EQUAL,
						Value:    &pb.Value{ValueType: &pb.Value_TimestampValue{TimestampValue: timestamppb.New(b.clock())}},
					}}},
					Limit: wrapperspb.Int32(batch),
				}},
			})
			if err != nil {
				return err
			}
			found = res.GetBatch().GetEntityResults()
			return nil
		})
		if err != nil {
			return total, fmt.Errorf("datastorelock: purge query: %w", err)
		}
		if len(found) == 0 {
			return total, nil
		}
		muts := make([]*pb.Mutation, 0, len(found))
		for _, r := range found {
			muts = append(muts, &pb.Mutation{
				Operation:                 &pb.Mutation_Delete{Delete: r.GetEntity().GetKey()},
				ConflictDetectionStrategy: &pb.Mutation_BaseVersion{BaseVersion: r.GetVersion()},
			})
		}
		var deleted int
		err = b.retry(ctx, func() error {
			res, err := b.rpc.Commit(b.ctx(ctx), &pb.CommitRequest{
				ProjectId: b.project, DatabaseId: b.database,
				Mode: pb.CommitRequest_NON_TRANSACTIONAL, Mutations: muts,
			})
			if err != nil {
				return err
			}
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
