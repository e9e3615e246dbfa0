package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"
	_ "modernc.org/sqlite" // the "sqlite" database/sql driver

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/pgxlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/spannerlock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// errStoreURL reports a --store value that names no backend or carries an
// option the backend does not have: a usage error.
var errStoreURL = errors.New("invalid --store")

// backend is an opened store and how to close it.
type backend struct {
	op    store.Operator
	close func() error
	// where names the records' place in the store (`prefix
	// "idempotency:"`, `table idempotency_keys`, ...) and option the
	// --store option that chooses it (?prefix=, ?table=, ...): the hint
	// for a key with no record.
	where, option string
}

// describeStore names the store a --store URL points at, for errors:
// its scheme and host (or file), never its user or password.
func describeStore(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil || u.Scheme == "" {
		return "the store"
	}
	switch {
	case u.Scheme == "sqlite":
		return "sqlite file " + strconv.Quote(u.Path)
	case u.Scheme == "spanner":
		return "spanner " + strconv.Quote(u.Host+u.Path)
	case u.Host == "":
		return u.Scheme + " store"
	}
	return u.Scheme + " at " + strconv.Quote(u.Host)
}

// opener opens the backend a --store URL names, whose service completes
// keys with ttl. Tests replace it.
type opener func(ctx context.Context, rawURL string, ttl time.Duration) (backend, error)

// storeHelp describes the --store URLs, for the usage text.
const storeHelp = `Store URLs (--store, or $IDEMCTL_STORE):
  redis://[user:password@]host:port[/db][?prefix=idempotency:]   (rediss:// for TLS)
  postgres://user:password@host:port/db[?sslmode=..][&table=idempotency_keys][&backend=pgxlock]
  mysql://user:password@host:port/db[?table=idempotency_keys]     (MySQL 8, MariaDB)
  sqlite:///path/to/file.db[?table=idempotency_keys]                (an existing database)
  datastore://PROJECT[?namespace=..][&kind=IdempotencyKey][&database=..]
  firestore://PROJECT[?collection=idempotency_keys][&database=(default)]
  spanner://projects/P/instances/I/databases/D[?table=IdempotencyKeys]
Each option is the one of the backend's constructor (redislock.WithPrefix,
sqllock.WithTable, datastorelock.WithKind/WithNamespace/WithDatabase,
firestorelock.WithCollection/WithDatabase, spannerlock.WithTable): give the
values your service uses. postgres:// reaches the table through sqllock
(database/sql) unless backend=pgxlock says through pgxlock (a pgx pool): the
table and the records are the same. Other query parameters of postgres://
and mysql:// go to the driver. The emulators are used when DATASTORE_EMULATOR_HOST,
FIRESTORE_EMULATOR_HOST or SPANNER_EMULATOR_HOST is set; otherwise the
Google Cloud backends use Application Default Credentials.`

// schemes lists the --store schemes, for errors.
const schemes = "redis://, postgres://, mysql://, sqlite://, datastore://, firestore://, spanner://"

// storeURL is a --store URL, checked: its query parsed strictly (a ';', a
// malformed escape or a repeated option is an error: url.Values.Get would
// drop or pick silently), and no fragment.
type storeURL struct {
	*url.URL
	q url.Values
}

// parseStoreURL parses rawURL strictly; every error wraps errStoreURL and
// never quotes the URL (it may hold a password).
func parseStoreURL(rawURL string) (storeURL, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		// Not err itself: a *url.Error quotes the whole URL, password
		// included.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return storeURL{}, fmt.Errorf("%w: the URL does not parse: %v", errStoreURL, err)
	}
	switch {
	case u.Scheme == "":
		return storeURL{}, fmt.Errorf("%w: not a URL (%s)", errStoreURL, schemes)
	case strings.Contains(rawURL, "#"):
		return storeURL{}, fmt.Errorf("%w: a '#' in the URL (a fragment): write it %%23 in a value", errStoreURL)
	}
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return storeURL{}, fmt.Errorf("%w: the query does not parse (options are separated by '&'; write ';' as %%3B in a value): %v", errStoreURL, err)
	}
	for k, v := range q {
		if len(v) > 1 {
			return storeURL{}, fmt.Errorf("%w: option %q given %d times", errStoreURL, k, len(v))
		}
	}
	return storeURL{u, q}, nil
}

// take removes option name from the query and returns its value, and
// whether it was there. An option given with an empty value is an error:
// the backend's default is had by leaving the option out.
func (s storeURL) take(name string) (string, bool, error) {
	if !s.q.Has(name) {
		return "", false, nil
	}
	v := s.q.Get(name)
	s.q.Del(name)
	if v == "" {
		return "", false, fmt.Errorf("%w: ?%s= is empty (leave it out for the default)", errStoreURL, name)
	}
	return v, true, nil
}

// only fails when the query holds more than the options taken.
func (s storeURL) only() error {
	for k := range s.q {
		return fmt.Errorf("%w: %s:// has no option %q", errStoreURL, s.Scheme, k)
	}
	return nil
}

// noUser fails for a URL with a user, a password or a port, which a
// Google Cloud store's URL never has.
func (s storeURL) noUser() error {
	if s.User != nil || s.Port() != "" {
		return fmt.Errorf("%w: %s:// takes no user, password or port", errStoreURL, s.Scheme)
	}
	return nil
}

// openStore opens the backend rawURL names. It checks the URL before any
// I/O: an unknown scheme or option, a malformed query or a path that is not
// what it seems is an error wrapping errStoreURL.
func openStore(ctx context.Context, rawURL string, ttl time.Duration) (backend, error) {
	u, err := parseStoreURL(rawURL)
	if err != nil {
		return backend{}, err
	}
	switch u.Scheme {
	case "redis", "rediss":
		prefix, hasPrefix, err := u.take("prefix")
		if err != nil {
			return backend{}, err
		}
		u.RawQuery = u.q.Encode()
		o, err := redis.ParseURL(u.String())
		if err != nil {
			return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
		}
		// go-redis logs every failed dial of its pool on stderr: the
		// error idemctl reports says it once.
		redis.SetLogger(quietLogger{})
		// The context's deadline (--timeout) bounds each command, not
		// only go-redis's own read and write timeouts.
		o.ContextTimeoutEnabled = true
		opts := []redislock.Option{redislock.WithTTL(ttl)}
		where := redislock.DefaultPrefix
		if hasPrefix {
			opts = append(opts, redislock.WithPrefix(prefix))
			where = prefix
		}
		c := redis.NewClient(o)
		b, err := redislock.New(c, opts...)
		if err != nil {
			c.Close()
			return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
		}
		return operator(b, c.Close, fmt.Sprintf("prefix %q", where), "?prefix=")
	case "postgres", "postgresql":
		table, _, err := u.take("table")
		if err != nil {
			return backend{}, err
		}
		through, _, err := u.take("backend")
		if err != nil {
			return backend{}, err
		}
		if through != "" && through != "sqllock" && through != "pgxlock" {
			return backend{}, fmt.Errorf("%w: postgres://: backend=%q: want sqllock (database/sql, the default) or pgxlock (a pgx pool)", errStoreURL, through)
		}
		u.RawQuery = u.q.Encode()
		// Parsed here, not at the first query: a bad driver option is a
		// usage error, as it is for mysql://.
		if through == "pgxlock" {
			cfg, err := pgxpool.ParseConfig(u.String())
			if err != nil {
				return backend{}, pgConfigError(err)
			}
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
			}
			return openPgx(pool, table, ttl)
		}
		cfg, err := pgx.ParseConfig(u.String())
		if err != nil {
			return backend{}, pgConfigError(err)
		}
		db := stdlib.OpenDB(*cfg)
		return openSQL(db, sqllock.Postgres, table, ttl)
	case "mysql":
		table, _, err := u.take("table")
		if err != nil {
			return backend{}, err
		}
		cfg, err := mysqlConfig(u.URL, u.q)
		if err != nil {
			return backend{}, err
		}
		conn, err := mysql.NewConnector(cfg)
		if err != nil {
			return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
		}
		return openSQL(sql.OpenDB(conn), sqllock.MySQL, table, ttl)
	case "sqlite":
		table, _, err := u.take("table")
		if err != nil {
			return backend{}, err
		}
		if err := u.only(); err != nil {
			return backend{}, err
		}
		path, err := sqlitePath(u.URL)
		if err != nil {
			return backend{}, err
		}
		// mode=rw: the database must exist. A tool that inspects a
		// service's store never creates one (a mistyped path would
		// otherwise leave an empty database file behind).
		db, err := sql.Open("sqlite", "file:"+path+"?mode=rw&_pragma=busy_timeout(10000)")
		if err != nil {
			return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
		}
		return openSQL(db, sqllock.SQLite, table, ttl)
	case "datastore":
		opts := []datastorelock.Option{datastorelock.WithTTL(ttl)}
		kind, namespace := datastorelock.DefaultKind, ""
		for _, o := range []struct {
			name string
			opt  func(string) datastorelock.Option
		}{{"namespace", datastorelock.WithNamespace}, {"kind", datastorelock.WithKind}, {"database", datastorelock.WithDatabase}} {
			v, ok, err := u.take(o.name)
			if err != nil {
				return backend{}, err
			}
			if ok {
				opts = append(opts, o.opt(v))
				switch o.name {
				case "kind":
					kind = v
				case "namespace":
					namespace = v
				}
			}
		}
		if err := errors.Join(u.only(), u.noUser()); err != nil {
			return backend{}, err
		}
		if u.Host == "" || (u.Path != "" && u.Path != "/") {
			return backend{}, fmt.Errorf("%w: datastore://PROJECT", errStoreURL)
		}
		b, err := datastorelock.Dial(ctx, u.Host, opts...)
		if err != nil {
			return backend{}, err
		}
		return operator(b, b.Close, fmt.Sprintf("kind %q, namespace %q", kind, namespace), "?namespace= or ?kind=")
	case "firestore":
		opts := []firestorelock.Option{firestorelock.WithTTL(ttl)}
		where := fmt.Sprintf("collection %q", firestorelock.DefaultCollection)
		if v, ok, err := u.take("collection"); err != nil {
			return backend{}, err
		} else if ok {
			opts = append(opts, firestorelock.WithCollection(v))
			where = fmt.Sprintf("collection %q", v)
		}
		if v, ok, err := u.take("database"); err != nil {
			return backend{}, err
		} else if ok {
			opts = append(opts, firestorelock.WithDatabase(v))
		}
		if err := errors.Join(u.only(), u.noUser()); err != nil {
			return backend{}, err
		}
		if u.Host == "" || (u.Path != "" && u.Path != "/") {
			return backend{}, fmt.Errorf("%w: firestore://PROJECT", errStoreURL)
		}
		b, err := firestorelock.Dial(ctx, u.Host, opts...)
		if err != nil {
			return backend{}, err
		}
		return operator(b, b.Close, where, "?collection=")
	case "spanner":
		opts := []spannerlock.Option{spannerlock.WithTTL(ttl)}
		where := fmt.Sprintf("table %s", spannerlock.DefaultTable)
		if v, ok, err := u.take("table"); err != nil {
			return backend{}, err
		} else if ok {
			opts = append(opts, spannerlock.WithTable(v))
			where = "table " + v
		}
		if err := errors.Join(u.only(), u.noUser()); err != nil {
			return backend{}, err
		}
		db := u.Host + u.Path
		if p := strings.Split(db, "/"); len(p) != 6 || p[0] != "projects" || p[2] != "instances" || p[4] != "databases" || p[1] == "" || p[3] == "" || p[5] == "" {
			return backend{}, fmt.Errorf("%w: spanner://projects/P/instances/I/databases/D", errStoreURL)
		}
		b, err := spannerlock.Dial(ctx, db, opts...)
		if err != nil {
			return backend{}, err
		}
		return operator(b, b.Close, where, "?table=")
	}
	return backend{}, fmt.Errorf("%w: unknown scheme %q (%s)", errStoreURL, u.Scheme, schemes)
}

// sqlitePath returns the file a sqlite:// URL names. The path is handed to
// SQLite as a file: URI, where '?' starts a query, '#' a fragment and '%'
// an escape: a path holding one of them (or a control character) would
// open, and create, another file than the one named, so it is refused.
func sqlitePath(u *url.URL) (string, error) {
	path := u.Path
	if u.Opaque != "" {
		path = u.Opaque
	}
	if u.Host != "" || u.User != nil || path == "" {
		return "", fmt.Errorf("%w: sqlite:///path/to/file.db (three slashes, then the path)", errStoreURL)
	}
	if i := strings.IndexFunc(path, func(r rune) bool { return r == '?' || r == '#' || r == '%' || r < 0x20 || r == 0x7f }); i >= 0 {
		return "", fmt.Errorf("%w: the sqlite path holds %q, which SQLite would read as part of a URI, opening another file: rename the file", errStoreURL, path[i:i+1])
	}
	return path, nil
}

// mysqlConfig turns mysql://user:password@host:port/db?params (table
// taken out) into the driver's configuration.
func mysqlConfig(u *url.URL, q url.Values) (*mysql.Config, error) {
	host := u.Host
	if host == "" {
		return nil, fmt.Errorf("%w: mysql://user:password@host:port/database", errStoreURL)
	}
	if u.Port() == "" {
		host += ":3306"
	}
	dsn := "tcp(" + host + ")/" + strings.TrimPrefix(u.Path, "/")
	if u.User != nil {
		pw, _ := u.User.Password()
		user := u.User.Username()
		if pw != "" {
			user += ":" + pw
		}
		dsn = user + "@" + dsn
	}
	if len(q) > 0 {
		dsn += "?" + q.Encode()
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errStoreURL, err)
	}
	return cfg, nil
}

// openSQL builds the sqllock backend on db.
func openSQL(db *sql.DB, d sqllock.Dialect, table string, ttl time.Duration) (backend, error) {
	opts := []sqllock.Option{sqllock.WithTTL(ttl)}
	where := "table " + sqllock.DefaultTable
	if table != "" {
		opts = append(opts, sqllock.WithTable(table))
		where = "table " + table
	}
	b, err := sqllock.New(db, d, opts...)
	if err != nil {
		db.Close()
		return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
	}
	return operator(b, func() error { return errors.Join(b.Close(), db.Close()) }, where, "?table=")
}

// openPgx returns the pgxlock backend on pool, on table ("" for the
// default, sqllock's).
func openPgx(pool *pgxpool.Pool, table string, ttl time.Duration) (backend, error) {
	opts := []pgxlock.Option{pgxlock.WithTTL(ttl)}
	where := "table " + pgxlock.DefaultTable
	if table != "" {
		opts = append(opts, pgxlock.WithTable(table))
		where = "table " + table
	}
	b, err := pgxlock.New(pool, opts...)
	if err != nil {
		pool.Close()
		return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
	}
	return operator(b, func() error { pool.Close(); return nil }, where, "?table=")
}

// pgConfigError is a postgres:// URL's refusal by pgx's parser, without
// the URL: only what follows the quoted URL (pgconn redacts the password
// there, but only as best it can).
func pgConfigError(err error) error {
	msg := err.Error()
	var pe *pgconn.ParseConfigError
	if errors.As(err, &pe) {
		if i := strings.LastIndex(msg, "`: "); i >= 0 {
			msg = msg[i+3:]
		} else {
			msg = "a driver option is invalid"
		}
	}
	return fmt.Errorf("%w: postgres://: %s", errStoreURL, msg)
}

// operator returns b as a store.Operator, or closes it and fails when its
// backend does not implement the operations interfaces.
func operator(b store.Backend, closeFn func() error, where, option string) (backend, error) {
	op, ok := b.(store.Operator)
	if !ok {
		closeFn()
		return backend{}, fmt.Errorf("%T does not implement store.Operator (Inspect, List, ForceRelease, Forget): build idemctl with a version of its module that does", b)
	}
	return backend{op: op, close: closeFn, where: where, option: option}, nil
}

// quietLogger drops go-redis's log lines.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}
