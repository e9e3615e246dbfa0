// Command idemctl shows and acts on the records an idempotency backend
// keeps: the on-call's tool for "was message X processed?", "this key is
// stuck" and "replay after a fix".
//
// Usage:
//
//	idemctl <command> [flags] [KEY]
//
// Commands:
//
//	get KEY       show one key's record
//	list          list records by --prefix and --state
//	count         count records by state under --prefix
//	release KEY   free a claimed key (its holder is fenced out)
//	forget KEY    delete a done key, so its next delivery runs again
//	forget --prefix P (--dry-run | --yes) [--done-from T] [--done-before T]
//	              delete every done key under P completed in a window
//	purge         delete expired records (SQL, Datastore, Firestore, Spanner)
//
// Every command takes --store URL (default $IDEMCTL_STORE), --json (one
// JSON document on stdout), --ttl (the ttl your service's backend uses,
// default 1h) and --timeout; `idemctl <command> --help` describes its own
// flags. The store URLs are those of [storeHelp], parsed strictly (a ';'
// in the query, an unknown, repeated or empty option, a '#', or a SQLite
// path that SQLite would read as a URI is a usage error). Text output
// shows a key as it is only when it is printable ASCII without spaces,
// '"' or '\'; any other key Go-quoted ([keyHelp]).
//
// Exit codes:
//
//	0  done
//	1  the operation failed or was refused (the store's error, a record
//	   that is not in the state the command acts on, a record that changed
//	   since it was read, a forget --prefix without --yes)
//	2  usage error: unknown command or flag, a bad flag value (--timeout
//	   must be positive), missing key, invalid --store
//	3  not found: get, release or forget of a key that has no record
//
// The commands are built on the admin package
// (github.com/gcp-pubsub-idempotency/idempotency/admin), whose guarded
// operations act only on the record as read.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/gcp-pubsub-idempotency/idempotency/admin"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
)

// Exit codes.
const (
	exitOK       = 0
	exitFailed   = 1
	exitUsage    = 2
	exitNotFound = 3
)

func main() {
	os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr, os.Getenv, openStore))
}

const usage = `idemctl shows and acts on the records of an idempotency store.

Usage:
  idemctl <command> [flags] [KEY]

Commands:
  get KEY        show one key's record
  list           list records (--prefix, --state, --limit)
  count          count records by state under --prefix
  release KEY    free a claimed key now; its holder is fenced out
  forget KEY     delete a done key, so that its next delivery runs again
  forget --prefix P (--dry-run | --yes) [--done-from T] [--done-before T]
                 delete the done keys under P completed in a window
  purge          delete expired records (not on Redis, which expires them)

Run 'idemctl <command> --help' for a command's flags.

Exit codes: 0 done; 1 failed or refused; 2 usage error; 3 no record for the key.

`

// command is one subcommand.
type command struct {
	name, args, help string
	// key: the command takes one KEY argument (required unless
	// optionalKey).
	key, optionalKey bool
	flags            func(fs *flag.FlagSet, o *opts)
	run              func(c *cli, key string) int
}

// opts is every flag value.
type opts struct {
	store      string
	json       bool
	ttl        time.Duration
	timeout    time.Duration
	prefix     string
	state      string
	limit      int
	all        bool
	yes        bool
	dryRun     bool
	doneFrom   string
	doneBefore string
}

// cli is one run's context.
type cli struct {
	ctx            context.Context
	stdout, stderr io.Writer
	o              opts
	b              store.Operator
	// where is the opened store (its where and option), for the hint
	// of a key with no record.
	where backend
}

var commands = []command{
	{name: "get", args: "KEY", key: true, help: "Shows KEY's record: state, fence, lease expiry, expires-at, fingerprint, version (a digest of\nthe claim token), and whether a Claim would win it now. It changes nothing.", run: (*cli).get},
	{name: "list", help: "Lists the records under --prefix (every record without it), in --state if set. It changes\nnothing.", flags: func(fs *flag.FlagSet, o *opts) {
		fs.StringVar(&o.prefix, "prefix", "", "list keys that start with `P`")
		fs.StringVar(&o.state, "state", "", "list only records in this state: claimed or done")
		fs.IntVar(&o.limit, "limit", 1000, "list at most `N` records (0: all)")
	}, run: (*cli).list},
	{name: "count", help: "Counts the records under --prefix (every record without it): claimed with a live lease,\nclaimed with a lapsed lease, done within the ttl, done past it. It changes nothing.", flags: func(fs *flag.FlagSet, o *opts) {
		fs.StringVar(&o.prefix, "prefix", "", "count keys that start with `P`")
	}, run: (*cli).count},
	{name: "release", args: "KEY", key: true, help: "Releases KEY's claim now, live or lapsed, whoever holds it: the next delivery wins the key at\nonce with a higher fence, and the old holder can no longer complete it. It reads the record,\nreleases exactly that record, and prints it before and after. It refuses a done key (exit 1)\nand a record that changed since the read (exit 1).", run: (*cli).release},
	{name: "forget", args: "KEY | --prefix P (--dry-run | --yes)", key: true, optionalKey: true, help: "Deletes KEY's done record before its ttl ends, so that the next delivery of KEY runs the work\nagain (a replay after a fix). It reads the record, deletes exactly that record, and prints it\nbefore and after. It never deletes a claim (exit 1: a free one needs nothing, its next delivery\nruns the work), nor a record that changed since the read (exit 1).\n\nWith --prefix (or --all) instead of KEY it plans to forget every done record under the\nprefix completed in the window --done-from..--done-before, prints the plan, and forgets the\nrecords one by one only with --yes (with --dry-run it stops at the plan). A record's\ncompletion time is its expires-at minus --ttl: give the ttl your service uses.", flags: func(fs *flag.FlagSet, o *opts) {
		fs.StringVar(&o.prefix, "prefix", "", "forget the done keys that start with `P`")
		fs.BoolVar(&o.all, "all", false, "forget done keys whatever their prefix (instead of --prefix)")
		fs.StringVar(&o.doneFrom, "done-from", "", "forget keys completed at or after `T` (RFC 3339, or a date: midnight UTC)")
		fs.StringVar(&o.doneBefore, "done-before", "", "forget keys completed before `T` (RFC 3339, or a date: midnight UTC)")
		fs.BoolVar(&o.yes, "yes", false, "forget the planned records")
		fs.BoolVar(&o.dryRun, "dry-run", false, "print the plan and forget nothing")
	}, run: (*cli).forget},
	{name: "purge", help: "Deletes the records whose expires-at has passed (they no longer suppress anything), up to\n--limit. SQL, Datastore, Firestore and Spanner keep them until purged; Redis deletes them\nitself, and purge fails there (exit 1).", flags: func(fs *flag.FlagSet, o *opts) {
		fs.IntVar(&o.limit, "limit", 0, "delete at most `N` records (0: no limit)")
	}, run: (*cli).purge},
}

// run runs idemctl with args and returns its exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string, open opener) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	switch args[0] {
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage+storeHelp+"\n")
		return exitOK
	}
	var cmd *command
	for i := range commands {
		if commands[i].name == args[0] {
			cmd = &commands[i]
		}
	}
	if cmd == nil {
		fmt.Fprintf(stderr, "idemctl: unknown command %q\n\n%s", args[0], usage)
		return exitUsage
	}
	c := &cli{stdout: stdout, stderr: stderr}
	fs := flag.NewFlagSet("idemctl "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	// No flag default from the environment: the usage would print it,
	// password included.
	fs.StringVar(&c.o.store, "store", "", "the store's `URL` (default $IDEMCTL_STORE)")
	fs.BoolVar(&c.o.json, "json", false, "print one JSON document")
	fs.DurationVar(&c.o.ttl, "ttl", store.DefaultTTL, "the ttl your service's backend applies (its WithTTL)")
	fs.DurationVar(&c.o.timeout, "timeout", time.Minute, "give up after `D`")
	if cmd.flags != nil {
		cmd.flags(fs, &c.o)
	}
	// The flag package prints nothing: --help prints the usage once, on
	// stdout, and a bad flag its error and a one-line hint, on stderr.
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	pos, err := parse(fs, args[1:])
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprintf(stdout, "Usage: idemctl %s [flags] %s\n\n%s\n\nFlags:\n", cmd.name, cmd.args, cmd.help)
		fs.SetOutput(stdout)
		fs.PrintDefaults()
		fmt.Fprintf(stdout, "\n%s\n\n%s\n\nExit codes: 0 done; 1 failed or refused; 2 usage error; 3 no record for the key.\n", storeHelp, keyHelp)
		return exitOK
	}
	if err != nil {
		return c.usageError(fs, "%v", err)
	}
	var key string
	switch {
	case len(pos) > 1 || (len(pos) == 1 && !cmd.key):
		return c.usageError(fs, "unexpected arguments %q", pos)
	case len(pos) == 1:
		key = pos[0]
	case cmd.key && !cmd.optionalKey:
		return c.usageError(fs, "%s needs a KEY", cmd.name)
	}
	if c.o.store == "" {
		c.o.store = getenv("IDEMCTL_STORE")
	}
	if c.o.store == "" {
		return c.usageError(fs, "no store: pass --store URL or set IDEMCTL_STORE")
	}
	if c.o.ttl <= 0 {
		return c.usageError(fs, "--ttl %v is not positive", c.o.ttl)
	}
	if c.o.timeout <= 0 {
		return c.usageError(fs, "--timeout %v is not positive (it bounds the whole command)", c.o.timeout)
	}
	if code, ok := c.check(fs, cmd.name, key); !ok {
		return code
	}
	return c.runTimed(ctx, fs, cmd, key, open)
}

// timeoutGrace is how long past --timeout a command may take to return
// after its context ended (a driver that notices the deadline late)
// before idemctl reports the timeout without it.
const timeoutGrace = 250 * time.Millisecond

// runTimed opens the store and runs cmd on key within --timeout: the
// context ends then, and if the store's client does not return soon after
// (timeoutGrace), the command is abandoned and reported as timed out.
// What the abandoned command would print later is dropped.
func (c *cli) runTimed(ctx context.Context, fs *flag.FlagSet, cmd *command, key string, open opener) int {
	ctx, cancel := context.WithTimeout(ctx, c.o.timeout)
	defer cancel()
	c.ctx = ctx
	stdout, stderr := &gate{w: c.stdout}, &gate{w: c.stderr}
	c.stdout, c.stderr = stdout, stderr
	done := make(chan int, 1)
	go func() {
		b, err := open(ctx, c.o.store, c.o.ttl)
		if errors.Is(err, errStoreURL) {
			done <- c.usageError(fs, "%v", err)
			return
		}
		if err != nil {
			done <- c.storeFail(fmt.Errorf("opening the store: %w", err), nil)
			return
		}
		defer b.close()
		c.b, c.where = b.op, b
		done <- cmd.run(c, key)
	}()
	select {
	case code := <-done:
		return code
	case <-ctx.Done():
	}
	select {
	case code := <-done:
		return code
	case <-time.After(timeoutGrace):
	}
	stdout.close()
	stderr.close()
	// A cli of its own: the abandoned command still uses c.
	report := &cli{stdout: stdout.w, stderr: stderr.w, o: c.o}
	return report.fail(exitFailed, fmt.Errorf("%s: no answer within --timeout %v; check that the server is up and reachable from here, or raise --timeout", describeStore(c.o.store), c.o.timeout), nil)
}

// gate is a writer that can be closed: writes after close are dropped,
// so that a command abandoned at its timeout cannot print past the
// report of it.
type gate struct {
	mu     sync.Mutex
	w      io.Writer
	closed bool
}

func (g *gate) Write(p []byte) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return len(p), nil
	}
	return g.w.Write(p)
}

func (g *gate) close() {
	g.mu.Lock()
	g.closed = true
	g.mu.Unlock()
}

// parse parses args with fs, flags and positional arguments in any order
// ("--" ends the flags), and returns the positional ones.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		if i := len(args) - len(rest); i > 0 && args[i-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// check validates the flags of command name before any I/O.
func (c *cli) check(fs *flag.FlagSet, name, key string) (int, bool) {
	switch name {
	case "list":
		if _, err := parseState(c.o.state); err != nil {
			return c.usageError(fs, "%v", err), false
		}
		if c.o.limit < 0 {
			return c.usageError(fs, "--limit %d is negative", c.o.limit), false
		}
	case "purge":
		if c.o.limit < 0 {
			return c.usageError(fs, "--limit %d is negative", c.o.limit), false
		}
	case "forget":
		bulk := c.o.prefix != "" || c.o.all || c.o.doneFrom != "" || c.o.doneBefore != "" || c.o.yes || c.o.dryRun
		switch {
		case key != "" && bulk:
			return c.usageError(fs, "forget takes a KEY or --prefix/--all with their flags, not both"), false
		case key != "":
			return 0, true
		case c.o.prefix == "" && !c.o.all:
			return c.usageError(fs, "forget needs a KEY, or --prefix P (or --all) to forget many"), false
		case c.o.prefix != "" && c.o.all:
			return c.usageError(fs, "--all and --prefix exclude each other"), false
		case c.o.yes && c.o.dryRun:
			return c.usageError(fs, "--yes and --dry-run exclude each other"), false
		}
		if _, err := c.filter(); err != nil {
			return c.usageError(fs, "%v", err), false
		}
	}
	return 0, true
}

// usageError prints msg and a pointer to --help, and returns exitUsage.
func (c *cli) usageError(fs *flag.FlagSet, format string, args ...any) int {
	fmt.Fprintf(c.stderr, "%s: %s\nRun '%s --help' for usage.\n", fs.Name(), fmt.Sprintf(format, args...), fs.Name())
	return exitUsage
}

// fail reports err and returns code: on stderr, and with --json as the
// document {"error": ..., "exit": code, ...extra} on stdout.
func (c *cli) fail(code int, err error, extra map[string]any) int {
	fmt.Fprintf(c.stderr, "idemctl: %s\n", safeText(err.Error()))
	if c.o.json {
		doc := map[string]any{"error": err.Error(), "exit": code}
		for k, v := range extra {
			doc[k] = v
		}
		c.emit(doc)
	}
	return code
}

// failOp maps an admin error to its exit code and reports it; for a key
// with no record it adds where idemctl looked.
func (c *cli) failOp(err error, extra map[string]any) int {
	if errors.Is(err, admin.ErrNotFound) {
		code := c.fail(exitNotFound, err, extra)
		fmt.Fprintf(c.stderr, "idemctl: looked under %s; if your service sets another, give it in --store (%s)\n", safeText(c.where.where), c.where.option)
		return code
	}
	return c.storeFail(err, extra)
}

// storeFail reports err, exit 1. An error of the connection to the store
// (its server down, unreachable, or slower than --timeout) is reported in
// one line with what to check, not as the drivers' chain of wrapped
// messages.
func (c *cli) storeFail(err error, extra map[string]any) int {
	var ne net.Error
	var oe *net.OpError
	switch {
	case errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()):
		err = fmt.Errorf("%s: no answer within --timeout %v; check that the server is up and reachable from here, or raise --timeout", describeStore(c.o.store), c.o.timeout)
	case errors.As(err, &oe):
		err = fmt.Errorf("%s: cannot reach the server (%v); check that it is up and that --store names its host and port", describeStore(c.o.store), oe)
	}
	return c.fail(exitFailed, err, extra)
}

// emit writes v as one indented JSON document on stdout.
func (c *cli) emit(v any) {
	enc := json.NewEncoder(c.stdout)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

// jsonRecord is a record in the JSON output.
type jsonRecord struct {
	Key   string `json:"key"`
	State string `json:"state"`
	Fence int64  `json:"fence"`
	// LeaseExpiry is set for a Claimed record only.
	LeaseExpiry string `json:"lease_expiry,omitempty"`
	ExpiresAt   string `json:"expires_at,omitempty"`
	// DoneAt is ExpiresAt - --ttl, for a Done record.
	DoneAt      string `json:"done_at,omitempty"`
	Fingerprint string `json:"fingerprint,omitempty"`
	Version     string `json:"version"`
	Now         string `json:"now"`
	Reclaimable bool   `json:"reclaimable"`
}

// rfc3339 formats t in UTC, or "" for the zero time.
func rfc3339(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339Nano)
}

func (c *cli) jsonRecord(r store.Record) jsonRecord {
	j := jsonRecord{
		Key: r.Key, State: r.State.String(), Fence: r.Fence, ExpiresAt: rfc3339(r.ExpiresAt),
		Fingerprint: r.Fingerprint, Version: r.Version, Now: rfc3339(r.Now),
		Reclaimable: r.Reclaimable(),
	}
	if r.State == store.Done {
		j.DoneAt = rfc3339(admin.DoneAt(r, c.o.ttl))
	}
	if r.State == store.Claimed {
		j.LeaseExpiry = rfc3339(r.LeaseExpiry)
	}
	return j
}

// jsonRecordPtr is jsonRecord for an optional record (nil: null).
func (c *cli) jsonRecordPtr(r *store.Record) *jsonRecord {
	if r == nil {
		return nil
	}
	j := c.jsonRecord(*r)
	return &j
}

// The states of a record in text output. A Claimed record whose lease has
// ended is free: the next delivery runs the work. The store keeps no
// reason with it, so it reads the same whether its claim was released (by
// a body that failed, or by idemctl release) or its holder died or hung
// until the lease lapsed; get tells what to do with it.
const (
	stateHeld        = "claimed, held"
	stateFree        = "claimed, free (released or lapsed)"
	stateDone        = "done, within ttl"
	stateDoneExpired = "done, ttl ended"
)

// status describes r's state in words.
func status(r store.Record) string {
	switch {
	case r.State == store.Claimed && !r.Reclaimable():
		return stateHeld
	case r.State == store.Claimed:
		return stateFree
	case r.State == store.Done && !r.Reclaimable():
		return stateDone
	case r.State == store.Done:
		return stateDoneExpired
	}
	return r.State.String()
}

// advice is what the operator may do about r, for get.
func advice(r store.Record) string {
	switch status(r) {
	case stateHeld:
		return "a delivery holds the key (its lease is live): its work is running, or its holder hung. If the holder is gone, `idemctl release` frees the key now; otherwise wait for the lease."
	case stateFree:
		return "the next delivery wins the key and runs the work. The claim was released (its body failed, or an operator released it) or its holder's lease lapsed (it died or hung): the store records no reason. Nothing to release or forget."
	case stateDone:
		return "the work is done: deliveries of the key are acknowledged without running it until its ttl ends. `idemctl forget` lets the next delivery run it again."
	case stateDoneExpired:
		return "the work was done, but the ttl has ended: the next delivery runs it again (purge deletes the record)."
	}
	return ""
}

// keyHelp says how text output shows keys, for the usage text.
const keyHelp = `Keys in text output: a key of printable ASCII without spaces, '"' or '\'
is shown as it is; any other key is shown Go-quoted ("orders:\x1b[2K\r..."),
so that no byte of a key reaches the terminal raw; so is a fingerprint.
--json prints every key as a JSON string.`

// showKey renders key (or a fingerprint) for text output: as it is when every byte is
// printable ASCII other than space, '"' and '\'; otherwise quoted by
// strconv.Quote, which escapes every byte that could move the cursor or
// start a line. A shown key starts with '"' exactly when it is quoted.
func showKey(key string) string {
	if key == "" {
		return `""`
	}
	for i := 0; i < len(key); i++ {
		if b := key[i]; b <= ' ' || b >= 0x7f || b == '"' || b == '\\' {
			return strconv.Quote(key)
		}
	}
	return key
}

// safeText returns s with every rune that is not printable (strconv.IsPrint)
// escaped as in a Go string, for messages that may quote a store's error.
func safeText(s string) string {
	if strings.IndexFunc(s, func(r rune) bool { return r != ' ' && !strconv.IsPrint(r) }) < 0 {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		if r == ' ' || (r != utf8.RuneError && strconv.IsPrint(r)) {
			b.WriteRune(r)
			continue
		}
		q := strconv.QuoteRune(r)
		b.WriteString(q[1 : len(q)-1])
	}
	return b.String()
}

// line is r on one line, for lists and before/after.
func (c *cli) line(r store.Record) string {
	s := fmt.Sprintf("%s  %s  fence %d", showKey(r.Key), status(r), r.Fence)
	switch r.State {
	case store.Claimed:
		if r.Reclaimable() {
			s += "  lease ended " + rfc3339(r.LeaseExpiry)
		} else {
			s += "  lease until " + rfc3339(r.LeaseExpiry)
		}
	case store.Done:
		s += "  done at " + rfc3339(admin.DoneAt(r, c.o.ttl))
	}
	return s + "  expires " + rfc3339(r.ExpiresAt) + "  version " + r.Version
}

func (c *cli) get(key string) int {
	r, err := admin.Get(c.ctx, c.b, key)
	if err != nil {
		return c.failOp(err, map[string]any{"key": key})
	}
	if c.o.json {
		c.emit(c.jsonRecord(r))
		return exitOK
	}
	w := tabwriter.NewWriter(c.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "key\t%s\n", showKey(r.Key))
	fmt.Fprintf(w, "state\t%s\n", status(r))
	fmt.Fprintf(w, "fence\t%d\n", r.Fence)
	if r.State == store.Claimed {
		fmt.Fprintf(w, "lease expiry\t%s\n", rfc3339(r.LeaseExpiry))
	} else {
		fmt.Fprintf(w, "done at\t%s (expires-at - ttl %v)\n", rfc3339(admin.DoneAt(r, c.o.ttl)), c.o.ttl)
	}
	fmt.Fprintf(w, "expires at\t%s\n", rfc3339(r.ExpiresAt))
	if r.Fingerprint != "" {
		fmt.Fprintf(w, "fingerprint\t%s\n", showKey(r.Fingerprint))
	}
	fmt.Fprintf(w, "version\t%s\n", r.Version)
	fmt.Fprintf(w, "read at\t%s\n", rfc3339(r.Now))
	w.Flush()
	fmt.Fprintf(c.stdout, "\n%s\n", advice(r))
	return exitOK
}

// parseState parses --state.
func parseState(s string) (store.State, error) {
	switch s {
	case "":
		return 0, nil
	case "claimed":
		return store.Claimed, nil
	case "done":
		return store.Done, nil
	}
	return 0, fmt.Errorf("--state %q: claimed or done", s)
}

// skipCounter is a store.Lister that counts the keys its pages skipped
// (store.Page.Skipped).
type skipCounter struct {
	store.Lister
	skipped int
}

func (s *skipCounter) List(ctx context.Context, q store.ListQuery) (store.Page, error) {
	p, err := s.Lister.List(ctx, q)
	s.skipped += p.Skipped
	return p, err
}

// noteSkipped tells, in text output, that a listing skipped n keys under
// the prefix that are not records.
func (c *cli) noteSkipped(n int) {
	if n > 0 && !c.o.json {
		fmt.Fprintf(c.stdout, "(skipped %d keys under the prefix that hold no idempotency record: another application's keys?)\n", n)
	}
}

func (c *cli) list(string) int {
	st, _ := parseState(c.o.state)
	recs := []jsonRecord{}
	more := false
	n := 0
	lister := &skipCounter{Lister: c.b}
	for r, err := range admin.List(c.ctx, lister, store.ListQuery{Prefix: c.o.prefix, State: st, Limit: store.MaxListLimit}) {
		if err != nil {
			return c.storeFail(err, nil)
		}
		if c.o.limit > 0 && n == c.o.limit {
			more = true
			break
		}
		n++
		if c.o.json {
			recs = append(recs, c.jsonRecord(r))
		} else {
			fmt.Fprintln(c.stdout, c.line(r))
		}
	}
	if c.o.json {
		c.emit(map[string]any{"records": recs, "more": more, "foreign_keys": lister.skipped})
		return exitOK
	}
	if more {
		fmt.Fprintf(c.stdout, "(stopped at --limit %d: more records follow)\n", c.o.limit)
	}
	c.noteSkipped(lister.skipped)
	return exitOK
}

func (c *cli) count(string) int {
	lister := &skipCounter{Lister: c.b}
	n, err := admin.Count(c.ctx, lister, c.o.prefix)
	if err != nil {
		return c.storeFail(err, nil)
	}
	if c.o.json {
		c.emit(map[string]any{
			"prefix": c.o.prefix, "claimed_live": n.ClaimedLive, "claimed_lapsed": n.ClaimedLapsed,
			"done_live": n.DoneLive, "done_expired": n.DoneExpired, "total": n.Total(),
			"foreign_keys": lister.skipped,
		})
		return exitOK
	}
	defer c.noteSkipped(lister.skipped)
	for _, row := range []struct {
		name string
		n    int
	}{
		{stateHeld, n.ClaimedLive}, {stateFree, n.ClaimedLapsed},
		{stateDone, n.DoneLive}, {stateDoneExpired, n.DoneExpired}, {"total", n.Total()},
	} {
		fmt.Fprintf(c.stdout, "%-36s %6d\n", row.name, row.n)
	}
	return exitOK
}

// change prints what release or forget did to one key.
func (c *cli) change(action string, ch admin.Change, err error) int {
	if err != nil {
		extra := map[string]any{"action": action}
		if ch.Before.Key != "" {
			extra["before"] = c.jsonRecord(ch.Before)
			if !c.o.json {
				fmt.Fprintf(c.stdout, "before: %s\n", c.line(ch.Before))
			}
		}
		return c.failOp(err, extra)
	}
	if c.o.json {
		c.emit(map[string]any{"action": action, "key": ch.Before.Key, "before": c.jsonRecord(ch.Before), "after": c.jsonRecordPtr(ch.After)})
		return exitOK
	}
	fmt.Fprintf(c.stdout, "before: %s\n", c.line(ch.Before))
	if ch.After != nil {
		fmt.Fprintf(c.stdout, "after:  %s\n", c.line(*ch.After))
	} else {
		fmt.Fprintf(c.stdout, "after:  no record\n")
	}
	past := map[string]string{"release": "released", "forget": "forgot"}[action]
	fmt.Fprintf(c.stdout, "%s %s\n", past, showKey(ch.Before.Key))
	return exitOK
}

func (c *cli) release(key string) int {
	ch, err := admin.Release(c.ctx, c.b, key)
	return c.change("release", ch, err)
}

// filter builds forget's filter from the flags.
func (c *cli) filter() (admin.Filter, error) {
	f := admin.Filter{Prefix: c.o.prefix, All: c.o.all, TTL: c.o.ttl}
	var err error
	if f.DoneFrom, err = parseTime("--done-from", c.o.doneFrom); err != nil {
		return f, err
	}
	if f.DoneBefore, err = parseTime("--done-before", c.o.doneBefore); err != nil {
		return f, err
	}
	if !f.DoneFrom.IsZero() && !f.DoneBefore.IsZero() && !f.DoneFrom.Before(f.DoneBefore) {
		return f, errors.New("--done-from must be before --done-before")
	}
	return f, nil
}

func (c *cli) forget(key string) int {
	if key != "" {
		ch, err := admin.Forget(c.ctx, c.b, key)
		return c.change("forget", ch, err)
	}
	f, _ := c.filter()
	apply := c.o.yes
	rep, err := admin.ForgetDone(c.ctx, c.b, f, !apply)
	if err != nil && rep.Plan == nil {
		return c.storeFail(err, nil)
	}
	keys := func(rs []store.Record) []string {
		out := []string{}
		for _, r := range rs {
			out = append(out, r.Key)
		}
		return out
	}
	doc := map[string]any{
		"action": "forget", "prefix": f.Prefix, "all": f.All, "ttl": f.TTL.String(),
		"done_from": rfc3339(f.DoneFrom), "done_before": rfc3339(f.DoneBefore),
		"dry_run": !apply, "forgotten": keys(rep.Forgotten), "skipped": keys(rep.Skipped),
	}
	plan := []jsonRecord{}
	for _, r := range rep.Plan {
		plan = append(plan, c.jsonRecord(r))
	}
	doc["plan"] = plan
	if !c.o.json {
		where := "under " + strconv.Quote(f.Prefix)
		if f.All {
			where = "under every prefix"
		}
		fmt.Fprintf(c.stdout, "plan: forget %d done records %s, completed %s (completion = expires-at - ttl %v)\n", len(rep.Plan), where, window(f), f.TTL)
		for _, r := range rep.Plan {
			fmt.Fprintf(c.stdout, "  %s\n", c.line(r))
		}
	}
	switch {
	case err != nil:
		return c.storeFail(err, doc)
	case !apply && !c.o.dryRun:
		return c.fail(exitFailed, fmt.Errorf("nothing forgotten: pass --yes to forget the %d records planned (or --dry-run)", len(rep.Plan)), doc)
	case !apply:
		if c.o.json {
			c.emit(doc)
		} else {
			fmt.Fprintln(c.stdout, "dry run: nothing forgotten")
		}
		return exitOK
	}
	if c.o.json {
		c.emit(doc)
	} else {
		fmt.Fprintf(c.stdout, "forgot %d, skipped %d (changed since the plan read them)\n", len(rep.Forgotten), len(rep.Skipped))
		for _, r := range rep.Skipped {
			fmt.Fprintf(c.stdout, "  skipped %s\n", showKey(r.Key))
		}
	}
	return exitOK
}

// parseTime parses the value v of flag name: an RFC 3339 time, or a date
// alone (midnight UTC); "" is the zero time.
func parseTime(name, v string) (time.Time, error) {
	if v == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return t, nil
	}
	if t, err := time.Parse(time.DateOnly, v); err == nil {
		return t, nil
	}
	return time.Time{}, fmt.Errorf("%s %q: want an RFC 3339 time (2026-12-03T14:00:00Z, 2026-12-03T15:00:00+01:00) or a date (2026-12-03, midnight UTC)", name, v)
}

// window describes f's completion window.
func window(f admin.Filter) string {
	switch {
	case f.DoneFrom.IsZero() && f.DoneBefore.IsZero():
		return "at any time"
	case f.DoneFrom.IsZero():
		return "before " + rfc3339(f.DoneBefore)
	case f.DoneBefore.IsZero():
		return "from " + rfc3339(f.DoneFrom)
	}
	return "from " + rfc3339(f.DoneFrom) + " to before " + rfc3339(f.DoneBefore)
}

func (c *cli) purge(string) int {
	n, err := admin.Purge(c.ctx, c.b, c.o.limit)
	if err != nil {
		return c.storeFail(err, map[string]any{"purged": n})
	}
	if c.o.json {
		c.emit(map[string]any{"purged": n})
	} else {
		fmt.Fprintf(c.stdout, "purged %d expired records\n", n)
	}
	return exitOK
}
