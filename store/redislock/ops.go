package redislock

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

var (
	//go:embed inspect.lua
	inspectLua string
	//go:embed forget.lua
	forgetLua string

	inspectScript = newScript(recordLua + inspectLua)
	forgetScript  = newScript(recordLua + forgetLua)
)

var _ store.Operator = (*Backend)(nil)

// The work of one call of List: at most maxListScans SCANs, each with
// COUNT max(limit, minScanCount). The floor keeps a listing with a small
// page from crawling a large keyspace a few keys per round trip (a
// listing must finish while its records live).
const (
	maxListScans = 16
	minScanCount = 100
)

// Inspect implements store.Inspector: one script reads the record and the
// server's clock (TIME) together, so Record.Now is the clock at the read,
// and writes nothing. A done record's ExpiresAt is the key's expiry
// (PEXPIRETIME), a claimed one's is its lease expiry + ttl; a key without an
// expiry (someone ran PERSIST on it) reports store.MaxInstant, for Claim
// treats such a done record as done for good. A done record's LeaseExpiry
// is zero: the record keeps none. Records of the earlier hash format are
// read too. A key that holds something other than a record is an error.
func (b *Backend) Inspect(ctx context.Context, key string) (store.Record, bool, error) {
	if err := store.ValidateKey(key); err != nil {
		return store.Record{}, false, err
	}
	rec, _, ok, err := b.read(ctx, key)
	if err != nil {
		return store.Record{}, false, fmt.Errorf("redislock: inspect %q: %w", key, err)
	}
	return rec, ok, nil
}

// read runs inspect.lua on key (resent after a network error: it writes
// nothing) and returns the record, its token, and whether there is one.
func (b *Backend) read(ctx context.Context, key string) (rec store.Record, token string, ok bool, err error) {
	cmd, _, err := b.run(ctx, inspectScript, resendable, nil, key)
	if err != nil {
		return store.Record{}, "", false, err
	}
	return inspectReply(key, cmd)
}

// inspectReply reads inspect.lua's reply for key (without the prefix).
func inspectReply(key string, cmd *redis.Cmd) (rec store.Record, token string, ok bool, err error) {
	v, err := cmd.Slice()
	if err != nil {
		return store.Record{}, "", false, err
	}
	// The reply as the error quotes it: without the token (a record's
	// seventh element), which only its holder may know.
	bad := func() error {
		quoted := slices.Clone(v)
		if len(quoted) > 6 {
			quoted[6] = "(token)"
		}
		return fmt.Errorf("unexpected reply %v", quoted)
	}
	if len(v) < 2 {
		return store.Record{}, "", false, bad()
	}
	kind, ok1 := v[0].(int64)
	now, ok2 := v[1].(int64)
	if !ok1 || !ok2 {
		return store.Record{}, "", false, bad()
	}
	switch {
	case kind == 0 && len(v) == 2:
		return store.Record{}, "", false, nil
	case kind == -1 && len(v) == 3:
		return store.Record{}, "", false, fmt.Errorf("%w: the key holds no record: %v", errNotARecord, v[2])
	case kind != 1 || len(v) != 8:
		return store.Record{}, "", false, bad()
	}
	state, _ := v[2].(string)
	fence, okF := v[3].(int64)
	lease, okL := v[4].(int64)
	expires, okE := v[5].(int64)
	token, okT := v[6].(string)
	fp, okP := v[7].(string)
	if !okF || !okL || !okE || !okT || !okP {
		return store.Record{}, "", false, bad()
	}
	rec = store.Record{Key: key, Fence: fence, Fingerprint: fp, Version: store.VersionOf(token), Now: time.UnixMilli(now)}
	switch state {
	case "c":
		rec.State = store.Claimed
		rec.LeaseExpiry = time.UnixMilli(lease)
	case "d":
		rec.State = store.Done
	default:
		return store.Record{}, "", false, bad()
	}
	if expires < 0 {
		rec.ExpiresAt = store.MaxInstant
	} else {
		rec.ExpiresAt = time.UnixMilli(expires)
	}
	return rec, token, true, nil
}

// errNotARecord reports a key under the prefix that holds something other
// than a record.
var errNotARecord = errors.New("redislock: not a record")

// ForceRelease implements store.ForceReleaser. Lua in Redis has no SHA-256,
// so the version cannot be compared inside one script: ForceRelease first
// reads the record (inspect.lua) and checks in Go that it is Claimed with
// r.Fence and that the digest of its token is r.Version, then runs the
// holder's own release script with that token, which releases only if the
// record is still claimed with that fence and that very token (one atomic
// compare-and-set: a record that moved on since the read, or was created
// afresh with another token, is left alone). Two round trips. The release
// raises the fence, sets the lease expiry to the server's now and the key's
// expiry to now + ttl, and keeps the token, exactly as Release does. A
// resend after a lost reply finds the raised fence and returns false.
func (b *Backend) ForceRelease(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	token, ok, err := b.current(ctx, r, store.Claimed)
	if err != nil || !ok {
		return false, wrapOp("force-release", r, err)
	}
	cmd, _, err := b.run(ctx, releaseScript, resendable, nil, r.Key, r.Fence, millis(b.ttl), token)
	if err != nil {
		return false, wrapOp("force-release", r, err)
	}
	n, err := cmd.Int64()
	if err != nil {
		return false, wrapOp("force-release", r, fmt.Errorf("unexpected reply: %w", err))
	}
	return n == 1, nil
}

// Forget implements store.Forgetter, in two round trips as ForceRelease:
// a read whose token's digest must be r.Version, then forget.lua, which
// deletes the record only if it is still done with r.Fence and that very
// token. A resend after a lost reply finds no record and returns false.
func (b *Backend) Forget(ctx context.Context, r store.Record) (bool, error) {
	if err := store.ValidateRecord(r); err != nil {
		return false, err
	}
	token, ok, err := b.current(ctx, r, store.Done)
	if err != nil || !ok {
		return false, wrapOp("forget", r, err)
	}
	cmd, _, err := b.run(ctx, forgetScript, resendable, nil, r.Key, r.Fence, token)
	if err != nil {
		return false, wrapOp("forget", r, err)
	}
	n, err := cmd.Int64()
	if err != nil {
		return false, wrapOp("forget", r, fmt.Errorf("unexpected reply: %w", err))
	}
	return n == 1, nil
}

// current reads r's key and returns its token when the record is in state
// with r's fence and version.
func (b *Backend) current(ctx context.Context, r store.Record, state store.State) (string, bool, error) {
	rec, token, ok, err := b.read(ctx, r.Key)
	if err != nil || !ok {
		return "", false, err
	}
	if rec.State != state || rec.Fence != r.Fence || rec.Version != r.Version {
		return "", false, nil
	}
	return token, true, nil
}

func wrapOp(op string, r store.Record, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("redislock: %s %q fence %d: %w", op, r.Key, r.Fence, err)
}

// List implements store.Lister with SCAN ... MATCH <prefix>* COUNT <limit>
// on the backend's keys (the backend's prefix and q.Prefix matched
// literally: glob characters in either are escaped, and every key is
// checked again for the prefix), then one pipeline of inspect.lua, one
// script per key, so that each record is read with the server's clock at
// its read, as Inspect reads it. Keys under the prefix that hold something
// other than a record, or whose name is not a valid key, are skipped, and
// counted in the page's Skipped.
//
// Bound: one call sends at most 16 SCANs with COUNT max(q.Limit, 100) to
// one server (each examines about that many keys of the whole keyspace)
// and reads at most q.Limit records (DefaultListLimit when zero). A page
// may therefore be short, even empty, with Next set.
//
// Order and repeats: records come in SCAN's order, not key order. Redis
// SCAN guarantees that a listing followed to its end returns every key
// that existed for the whole listing, but it may return a key more than
// once (when Redis resizes its tables between calls): a record may appear
// on more than one page, and a caller that needs each once dedupes by
// key. When a SCAN reply holds more records than the page has room for,
// Next resumes at the same SCAN cursor and carries a 64-bit digest of
// each key already taken from it, so that none of that reply is lost:
// such a cursor grows by 8 bytes per key taken from that reply (a reply
// holds about COUNT keys: some 11 KB of cursor for COUNT MaxListLimit).
//
// On a *redis.ClusterClient the listing scans each master in turn
// (ordered by address); Next names the master. A listing that spans a
// failover or a resharding may miss keys that moved during it, and a
// cursor naming a node that is no longer a master is an error: start the
// listing again. Other clients must implement redis.Cmdable (every
// go-redis client but a Ring, which New refuses).
//
// Next is opaque; a cursor from another prefix, state or backend prefix
// is refused with an error wrapping store.ErrInvalidQuery, before any I/O.
func (b *Backend) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	if err := store.ValidateQuery(q); err != nil {
		return store.Page{}, err
	}
	cur, err := b.decodeCursor(q)
	if err != nil {
		return store.Page{}, err
	}
	limit := q.Limit
	if limit == 0 {
		limit = store.DefaultListLimit
	}
	node, name, next, err := b.listNode(ctx, cur.node)
	if err != nil {
		return store.Page{}, fmt.Errorf("redislock: list: %w", err)
	}
	cur.node = name
	full := b.prefix + q.Prefix
	match := globEscape(full) + "*"
	var page store.Page
	read := 0
	for scans := 0; scans < maxListScans && read < limit && len(page.Records) < limit; scans++ {
		keys, after, err := node.Scan(ctx, cur.scan, match, int64(max(limit, minScanCount))).Result()
		if err != nil {
			return store.Page{}, fmt.Errorf("redislock: list: SCAN: %w", err)
		}
		all := candidates(keys, full, cur.seen)
		batch := all[:min(len(all), limit-read)]
		recs, foreign, err := b.readKeys(ctx, node, batch)
		if err != nil {
			return store.Page{}, fmt.Errorf("redislock: list: %w", err)
		}
		read += len(batch)
		taken := 0
		for i, rec := range recs {
			taken = i + 1
			if foreign[i] {
				page.Skipped++
			}
			if rec != nil && (q.State == 0 || rec.State == q.State) {
				page.Records = append(page.Records, *rec)
				if len(page.Records) == limit {
					break
				}
			}
		}
		if taken < len(all) {
			// The page is full (or this call's reads are spent) within
			// this SCAN reply: resume at the same cursor, past the keys
			// taken from it.
			for _, k := range batch[:taken] {
				cur.seen = append(cur.seen, digest(k))
			}
			page.Next = b.encodeCursor(q, cur)
			return page, nil
		}
		cur.scan, cur.seen = after, nil
		if after == 0 {
			// This server is done: the next page starts on the next
			// master, or the listing is complete.
			if next == "" {
				page.Next = ""
				return page, nil
			}
			cur.node = next
			break
		}
	}
	page.Next = b.encodeCursor(q, cur)
	return page, nil
}

// candidates returns the keys of a SCAN reply that are under full, not
// already taken from this reply (seen), once each, in key order.
func candidates(keys []string, full string, seen []uint64) []string {
	taken := make(map[uint64]bool, len(seen))
	for _, d := range seen {
		taken[d] = true
	}
	var out []string
	for _, k := range keys {
		if !strings.HasPrefix(k, full) || taken[digest(k)] {
			continue
		}
		out = append(out, k)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// readKeys reads the records at keys (full Redis keys) on node in one
// pipeline of inspect.lua: a nil entry for a key with no record, one that
// holds something else, or whose name is not a valid key; the second
// result is true for the last two (another application's keys).
func (b *Backend) readKeys(ctx context.Context, node redis.Cmdable, keys []string) ([]*store.Record, []bool, error) {
	if len(keys) == 0 {
		return nil, nil, nil
	}
	for loaded := false; ; loaded = true {
		cmds, err := node.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, k := range keys {
				p.EvalSha(ctx, inspectScript.Hash(), []string{k})
			}
			return nil
		})
		if err != nil && !loaded && isNoScript(err) {
			if err := node.ScriptLoad(ctx, inspectScript.src).Err(); err != nil {
				return nil, nil, fmt.Errorf("SCRIPT LOAD: %w", err)
			}
			continue
		}
		out := make([]*store.Record, len(keys))
		foreign := make([]bool, len(keys))
		for i, c := range cmds {
			key := keys[i][len(b.prefix):]
			if store.ValidateKey(key) != nil {
				foreign[i] = true
				continue
			}
			rec, _, ok, err := inspectReply(key, c.(*redis.Cmd))
			switch {
			case errors.Is(err, errNotARecord):
				foreign[i] = true
			case err != nil:
				return nil, nil, fmt.Errorf("read %q: %w", key, err)
			case ok:
				out[i] = &rec
			}
		}
		return out, foreign, nil
	}
}

func isNoScript(err error) bool {
	return errors.Is(err, redis.ErrNoScript) || redis.HasErrorPrefix(err, "NOSCRIPT")
}

// listNode returns the server to scan for a cursor's node ("" for the
// first), its name, and the name of the node that follows it ("" when it
// is the last). A client that is not a cluster client is one server, named
// "".
func (b *Backend) listNode(ctx context.Context, name string) (node redis.Cmdable, named, next string, err error) {
	cc, ok := b.client.(*redis.ClusterClient)
	if !ok {
		c, ok := b.client.(redis.Cmdable)
		if !ok {
			return nil, "", "", fmt.Errorf("the client %T cannot SCAN", b.client)
		}
		if name != "" {
			return nil, "", "", fmt.Errorf("%w: a cluster's cursor on a client that is not a cluster client", store.ErrInvalidQuery)
		}
		return c, "", "", nil
	}
	var mu sync.Mutex
	masters := map[string]*redis.Client{}
	err = cc.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		defer mu.Unlock()
		masters[c.Options().Addr] = c
		return nil
	})
	if err != nil {
		return nil, "", "", err
	}
	addrs := make([]string, 0, len(masters))
	for a := range masters {
		addrs = append(addrs, a)
	}
	sort.Strings(addrs)
	if len(addrs) == 0 {
		return nil, "", "", errors.New("the cluster has no master")
	}
	i := 0
	if name != "" {
		i = slices.Index(addrs, name)
		if i < 0 {
			return nil, "", "", fmt.Errorf("the cursor's node %s is no longer a master of the cluster (a failover or resharding): start the listing again", name)
		}
	}
	if i+1 < len(addrs) {
		next = addrs[i+1]
	}
	return masters[addrs[i]], addrs[i], next, nil
}

// globEscape escapes the characters SCAN's MATCH pattern reads as glob
// syntax, so that s matches literally.
func globEscape(s string) string {
	var sb strings.Builder
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '*', '?', '[', ']', '\\', '^', '-':
			sb.WriteByte('\\')
		}
		sb.WriteByte(s[i])
	}
	return sb.String()
}

// digest is the first 8 bytes of key's SHA-256 digest.
func digest(key string) uint64 {
	sum := sha256.Sum256([]byte(key))
	return binary.BigEndian.Uint64(sum[:8])
}

// listCursor is where a listing resumes: on node ("" for the only server
// or the first master), at SCAN cursor scan, past the keys of that SCAN's
// reply whose digests are seen.
type listCursor struct {
	node string
	scan uint64
	seen []uint64
}

// cursorTag starts every cursor List issues.
const cursorTag = "r1."

// queryCheck binds a cursor to the backend's prefix and the query's prefix
// and state.
func (b *Backend) queryCheck(q store.ListQuery) []byte {
	sum := sha256.Sum256([]byte(fmt.Sprintf("%q\x00%q\x00%d", b.prefix, q.Prefix, q.State)))
	return sum[:8]
}

func (b *Backend) encodeCursor(q store.ListQuery, c listCursor) string {
	raw := b.queryCheck(q)
	raw = binary.AppendUvarint(raw, c.scan)
	raw = binary.AppendUvarint(raw, uint64(len(c.node)))
	raw = append(raw, c.node...)
	raw = binary.AppendUvarint(raw, uint64(len(c.seen)))
	for _, d := range c.seen {
		raw = binary.BigEndian.AppendUint64(raw, d)
	}
	return cursorTag + base64.RawURLEncoding.EncodeToString(raw)
}

// decodeCursor reads q.Cursor: the start of a listing when empty, or an
// error wrapping store.ErrInvalidQuery when this backend did not issue it
// for the same prefixes and state.
func (b *Backend) decodeCursor(q store.ListQuery) (listCursor, error) {
	if q.Cursor == "" {
		return listCursor{}, nil
	}
	bad := fmt.Errorf("%w: a cursor this backend did not issue for this prefix and state", store.ErrInvalidQuery)
	s, ok := strings.CutPrefix(q.Cursor, cursorTag)
	if !ok {
		return listCursor{}, bad
	}
	raw, err := base64.RawURLEncoding.DecodeString(s)
	check := b.queryCheck(q)
	if err != nil || len(raw) < len(check) || string(raw[:len(check)]) != string(check) {
		return listCursor{}, bad
	}
	raw = raw[len(check):]
	var c listCursor
	var n int
	if c.scan, n = binary.Uvarint(raw); n <= 0 {
		return listCursor{}, bad
	}
	raw = raw[n:]
	l, n := binary.Uvarint(raw)
	if n <= 0 || l > uint64(len(raw)-n) {
		return listCursor{}, bad
	}
	c.node, raw = string(raw[n:n+int(l)]), raw[n+int(l):]
	cnt, n := binary.Uvarint(raw)
	if n <= 0 || cnt != uint64(len(raw)-n)/8 || (len(raw)-n)%8 != 0 {
		return listCursor{}, bad
	}
	raw = raw[n:]
	for i := 0; i < len(raw); i += 8 {
		c.seen = append(c.seen, binary.BigEndian.Uint64(raw[i:]))
	}
	return c, nil
}
