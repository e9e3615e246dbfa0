package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/redis/go-redis/v9"
	_ "modernc.org/sqlite" // the "sqlite" database/sql driver

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/firestorelock"
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
}

// opener opens the backend a --store URL names, whose service completes
// keys with ttl. Tests replace it.
type opener func(ctx context.Context, rawURL string, ttl time.Duration) (backend, error)

// storeHelp describes the --store URLs, for the usage text.
const storeHelp = `Store URLs (--store, or $IDEMCTL_STORE):
  redis://[user:password@]host:port[/db][?prefix=idempotency:]   (rediss:// for TLS)
  postgres://user:password@host:port/db[?sslmode=..][&table=idempotency_keys]
  mysql://user:password@host:port/db[?table=idempotency_keys]     (MySQL 8, MariaDB)
  sqlite:///path/to/file.db[?table=idempotency_keys]                (an existing database)
  datastore://PROJECT[?namespace=..][&kind=IdempotencyKey][&database=..]
  firestore://PROJECT[?collection=idempotency_keys][&database=(default)]
  spanner://projects/P/instances/I/databases/D[?table=IdempotencyKeys]
Each option is the one of the backend's constructor (redislock.WithPrefix,
sqllock.WithTable, datastorelock.WithKind/WithNamespace/WithDatabase,
firestorelock.WithCollection/WithDatabase, spannerlock.WithTable): give the
values your service uses. Other query parameters of postgres:// and mysql://
go to the driver. The emulators are used when DATASTORE_EMULATOR_HOST,
FIRESTORE_EMULATOR_HOST or SPANNER_EMULATOR_HOST is set; otherwise the
Google Cloud backends use Application Default Credentials.`

// openStore opens the backend rawURL names. It checks the URL before any
// I/O: an unknown scheme or option is an error wrapping errStoreURL.
func openStore(ctx context.Context, rawURL string, ttl time.Duration) (backend, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		// Not err itself: a *url.Error quotes the whole URL, password
		// included.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return backend{}, fmt.Errorf("%w: the URL does not parse: %v", errStoreURL, err)
	}
	q := u.Query()
	// take removes and returns the option name of q.
	take := func(name string) string {
		v := q.Get(name)
		q.Del(name)
		return v
	}
	// only fails when q holds more than the options taken.
	only := func() error {
		for k := range q {
			return fmt.Errorf("%w: %s:// has no option %q", errStoreURL, u.Scheme, k)
		}
		return nil
	}
	switch u.Scheme {
	case "redis", "rediss":
		prefix, hasPrefix := q.Get("prefix"), q.Has("prefix")
		q.Del("prefix")
		u.RawQuery = q.Encode()
		o, err := redis.ParseURL(u.String())
		if err != nil {
			return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
		}
		opts := []redislock.Option{redislock.WithTTL(ttl)}
		if hasPrefix {
			opts = append(opts, redislock.WithPrefix(prefix))
		}
		c := redis.NewClient(o)
		b, err := redislock.New(c, opts...)
		if err != nil {
			c.Close()
			return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
		}
		return operator(b, c.Close)
	case "postgres", "postgresql":
		table := take("table")
		u.RawQuery = q.Encode()
		db, err := sql.Open("pgx", u.String())
		if err != nil {
			return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
		}
		return openSQL(db, sqllock.Postgres, table, ttl)
	case "mysql":
		table := take("table")
		cfg, err := mysqlConfig(u, q)
		if err != nil {
			return backend{}, err
		}
		conn, err := mysql.NewConnector(cfg)
		if err != nil {
			return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
		}
		return openSQL(sql.OpenDB(conn), sqllock.MySQL, table, ttl)
	case "sqlite":
		table := take("table")
		if err := only(); err != nil {
			return backend{}, err
		}
		path := u.Path
		if u.Opaque != "" {
			path = u.Opaque
		}
		if u.Host != "" || path == "" {
			return backend{}, fmt.Errorf("%w: sqlite:///path/to/file.db (three slashes, then the path)", errStoreURL)
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
		if q.Has("namespace") {
			opts = append(opts, datastorelock.WithNamespace(take("namespace")))
		}
		if q.Has("kind") {
			opts = append(opts, datastorelock.WithKind(take("kind")))
		}
		if q.Has("database") {
			opts = append(opts, datastorelock.WithDatabase(take("database")))
		}
		if err := only(); err != nil {
			return backend{}, err
		}
		if u.Host == "" || (u.Path != "" && u.Path != "/") {
			return backend{}, fmt.Errorf("%w: datastore://PROJECT", errStoreURL)
		}
		b, err := datastorelock.Dial(ctx, u.Host, opts...)
		if err != nil {
			return backend{}, err
		}
		return operator(b, b.Close)
	case "firestore":
		opts := []firestorelock.Option{firestorelock.WithTTL(ttl)}
		if q.Has("collection") {
			opts = append(opts, firestorelock.WithCollection(take("collection")))
		}
		if q.Has("database") {
			opts = append(opts, firestorelock.WithDatabase(take("database")))
		}
		if err := only(); err != nil {
			return backend{}, err
		}
		if u.Host == "" || (u.Path != "" && u.Path != "/") {
			return backend{}, fmt.Errorf("%w: firestore://PROJECT", errStoreURL)
		}
		b, err := firestorelock.Dial(ctx, u.Host, opts...)
		if err != nil {
			return backend{}, err
		}
		return operator(b, b.Close)
	case "spanner":
		opts := []spannerlock.Option{spannerlock.WithTTL(ttl)}
		if q.Has("table") {
			opts = append(opts, spannerlock.WithTable(take("table")))
		}
		if err := only(); err != nil {
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
		return operator(b, b.Close)
	case "":
		return backend{}, fmt.Errorf("%w: %q is not a URL (redis://, postgres://, mysql://, sqlite://, datastore://, firestore://, spanner://)", errStoreURL, rawURL)
	}
	return backend{}, fmt.Errorf("%w: unknown scheme %q (redis://, postgres://, mysql://, sqlite://, datastore://, firestore://, spanner://)", errStoreURL, u.Scheme)
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
	if table != "" {
		opts = append(opts, sqllock.WithTable(table))
	}
	b, err := sqllock.New(db, d, opts...)
	if err != nil {
		db.Close()
		return backend{}, fmt.Errorf("%w: %w", errStoreURL, err)
	}
	return operator(b, func() error { return errors.Join(b.Close(), db.Close()) })
}

// operator returns b as a store.Operator, or closes it and fails when its
// backend does not implement the operations interfaces.
func operator(b store.Backend, closeFn func() error) (backend, error) {
	op, ok := b.(store.Operator)
	if !ok {
		closeFn()
		return backend{}, fmt.Errorf("%T does not implement store.Operator (Inspect, List, ForceRelease, Forget): build idemctl with a version of its module that does", b)
	}
	return backend{op: op, close: closeFn}, nil
}
