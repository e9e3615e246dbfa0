package orders

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
	"github.com/redis/go-redis/v9"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/retry"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/redislock"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// The backend kinds [Choice.Kind] holds, as IDEMPOTENCY_BACKEND names them.
const (
	Datastore = "datastore"
	Redis     = "redis"
	Postgres  = "postgres"
	Memory    = "memory"
)

// AllowMemoryOnCloudRun is the variable that lets IDEMPOTENCY_BACKEND=memory
// start on Cloud Run (set to true). Without it that is refused: every
// instance keeps its own in-memory records and loses them when it stops,
// so a redelivery that reaches another instance, or a restarted one, runs
// the handler again. It is for a throwaway deployment of the example that
// accepts duplicates, never for one that sends real orders.
const AllowMemoryOnCloudRun = "IDEMPOTENCY_ALLOW_MEMORY_ON_CLOUD_RUN"

// MetadataProjectURL is where the metadata server of Cloud Run (and of
// every Google compute platform) tells the project the service runs in.
const MetadataProjectURL = "http://metadata.google.internal/computeMetadata/v1/project/project-id"

// Env is where [Env.Setup] reads its configuration: the variables of the
// package documentation and, on Cloud Run without a project variable, the
// metadata server. The zero Env reads the process's environment and the
// real metadata server; tests fill in the fields.
type Env struct {
	// Getenv reads a variable; nil means os.Getenv.
	Getenv func(string) string
	// MetadataURL replaces the project-id URL of the metadata server.
	// Empty means http://$GCE_METADATA_HOST/computeMetadata/v1/project/project-id
	// when GCE_METADATA_HOST is set (as Google's client libraries read
	// it), else [MetadataProjectURL].
	MetadataURL string
	// MetadataTimeout bounds the whole metadata lookup, retries included.
	// Zero means 10s.
	MetadataTimeout time.Duration
}

// Choice is a backend chosen by [Env.Choose] or [Env.Named]: its kind and
// the settings [Open] needs for it.
type Choice struct {
	// Kind is [Datastore], [Redis], [Postgres] or [Memory].
	Kind string
	// Project is the Datastore project, and ProjectFrom where it came
	// from: "DATASTORE_PROJECT_ID", "GOOGLE_CLOUD_PROJECT" or
	// "metadata server".
	Project, ProjectFrom string
	// RedisAddr is REDIS_ADDR, for Redis.
	RedisAddr string
	// PostgresDSN is POSTGRES_DSN, for PostgreSQL.
	PostgresDSN string
}

// Setup reads the configuration from the process's environment and builds
// the backend: what both the function and the Cloud Run service do at
// start-up. It is Env{}.Setup.
func Setup(ctx context.Context) (store.Backend, time.Duration, error) {
	return Env{}.Setup(ctx)
}

// Setup reads the lease and the backend's configuration and opens the
// backend [Env.Choose] picks.
func (e Env) Setup(ctx context.Context) (store.Backend, time.Duration, error) {
	lease, err := leaseFrom(e.getenv("IDEMPOTENCY_LEASE"))
	if err != nil {
		return nil, 0, err
	}
	c, err := e.Choose(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("idempotency backend: %w", err)
	}
	b, err := Open(ctx, c)
	if err != nil {
		return nil, 0, fmt.Errorf("idempotency backend: %w", err)
	}
	if c.Kind == Datastore {
		slog.InfoContext(ctx, "idempotency backend", "backend", c.Kind, "project", c.Project, "project_from", c.ProjectFrom)
	} else {
		slog.InfoContext(ctx, "idempotency backend", "backend", c.Kind)
	}
	return b, lease, nil
}

// Backend opens the backend the process's environment chooses
// ([Env.Choose]), as Setup does, without reading the lease.
func Backend(ctx context.Context) (store.Backend, error) {
	c, err := Env{}.Choose(ctx)
	if err != nil {
		return nil, err
	}
	return Open(ctx, c)
}

// Choose picks the backend of a deployed function or service, from
// IDEMPOTENCY_BACKEND or, unset, from the variables that are set: REDIS_ADDR,
// else POSTGRES_DSN, else a project (DATASTORE_PROJECT_ID or
// GOOGLE_CLOUD_PROJECT) for Datastore. Both REDIS_ADDR and POSTGRES_DSN
// without IDEMPOTENCY_BACKEND is an error.
//
// On Cloud Run (K_SERVICE set) it never falls back to the in-memory store,
// which would de-duplicate within one instance only: without a project
// variable it asks the metadata server for the project and uses Datastore,
// and when the server does not answer it fails, saying what to set. An
// explicit IDEMPOTENCY_BACKEND=memory there is refused too, unless
// [AllowMemoryOnCloudRun] is true. Elsewhere, with nothing configured, it
// picks the in-memory store, for a function run on a developer's machine.
func (e Env) Choose(ctx context.Context) (Choice, error) {
	service := e.getenv("K_SERVICE")
	kind := e.getenv("IDEMPOTENCY_BACKEND")
	if kind == "" {
		redisAddr, dsn := e.getenv("REDIS_ADDR"), e.getenv("POSTGRES_DSN")
		switch {
		case redisAddr != "" && dsn != "":
			return Choice{}, errors.New("both REDIS_ADDR and POSTGRES_DSN are set: choose one with IDEMPOTENCY_BACKEND=redis or postgres")
		case redisAddr != "":
			kind = Redis
		case dsn != "":
			kind = Postgres
		case e.projectVar() != "" || service != "":
			kind = Datastore
		default:
			return Choice{Kind: Memory}, nil
		}
	}
	switch kind {
	case Datastore:
		c, err := e.Named(Datastore)
		if err == nil || service == "" {
			return c, err
		}
		project, err := e.metadataProject(ctx)
		if err != nil {
			return Choice{}, fmt.Errorf("on Cloud Run (K_SERVICE=%s) the records need a shared store, and no project for Datastore is set "+
				"and the metadata server did not give one (%w): set GOOGLE_CLOUD_PROJECT, or IDEMPOTENCY_BACKEND=redis with REDIS_ADDR, "+
				"or IDEMPOTENCY_BACKEND=postgres with POSTGRES_DSN", service, err)
		}
		return Choice{Kind: Datastore, Project: project, ProjectFrom: "metadata server"}, nil
	case Memory:
		if service == "" {
			return Choice{Kind: Memory}, nil
		}
		allow := e.getenv(AllowMemoryOnCloudRun)
		ok, err := strconv.ParseBool(allow)
		if allow != "" && err != nil {
			return Choice{}, fmt.Errorf("%s=%q: want true or false", AllowMemoryOnCloudRun, allow)
		}
		if !ok {
			return Choice{}, fmt.Errorf("IDEMPOTENCY_BACKEND=memory on Cloud Run (K_SERVICE=%s) de-duplicates within one instance only, "+
				"and forgets on every restart: choose datastore, redis or postgres, or set %s=true for a deployment that accepts duplicates",
				service, AllowMemoryOnCloudRun)
		}
		slog.WarnContext(ctx, "IDEMPOTENCY_BACKEND=memory on Cloud Run: a redelivery that reaches another instance, or a restarted one, runs the handler again",
			"override", AllowMemoryOnCloudRun)
		return Choice{Kind: Memory}, nil
	}
	return e.Named(kind)
}

// Named returns the settings of the backend kind, named explicitly (by
// cmd/local's -backend flag, say), from the variables alone: REDIS_ADDR for
// redis, POSTGRES_DSN for postgres, DATASTORE_PROJECT_ID or
// GOOGLE_CLOUD_PROJECT for datastore, nothing for memory. It fails on an
// unknown kind and on a missing setting; it never asks the metadata server.
func (e Env) Named(kind string) (Choice, error) {
	switch kind {
	case Redis:
		addr := e.getenv("REDIS_ADDR")
		if addr == "" {
			return Choice{}, errors.New("the redis backend needs REDIS_ADDR")
		}
		return Choice{Kind: Redis, RedisAddr: addr}, nil
	case Postgres:
		dsn := e.getenv("POSTGRES_DSN")
		if dsn == "" {
			return Choice{}, errors.New("the postgres backend needs POSTGRES_DSN")
		}
		return Choice{Kind: Postgres, PostgresDSN: dsn}, nil
	case Datastore:
		for _, v := range []string{"DATASTORE_PROJECT_ID", "GOOGLE_CLOUD_PROJECT"} {
			if p := e.getenv(v); p != "" {
				return Choice{Kind: Datastore, Project: p, ProjectFrom: v}, nil
			}
		}
		return Choice{}, errors.New("the datastore backend needs GOOGLE_CLOUD_PROJECT or DATASTORE_PROJECT_ID")
	case Memory:
		return Choice{Kind: Memory}, nil
	}
	return Choice{}, fmt.Errorf("backend %q: want datastore, redis, postgres or memory", kind)
}

// Open connects to the backend c describes and checks that it answers.
func Open(ctx context.Context, c Choice) (store.Backend, error) {
	switch c.Kind {
	case Redis:
		return redisBackend(ctx, c.RedisAddr)
	case Postgres:
		return postgresBackend(ctx, c.PostgresDSN)
	case Datastore:
		if c.Project == "" {
			return nil, errors.New("datastore: no project")
		}
		return datastorelock.Dial(ctx, c.Project)
	case Memory:
		return fake.New(), nil
	}
	return nil, fmt.Errorf("backend %q: want datastore, redis, postgres or memory", c.Kind)
}

func (e Env) getenv(k string) string {
	if e.Getenv != nil {
		return e.Getenv(k)
	}
	return os.Getenv(k)
}

// projectVar is the project a variable names, if any.
func (e Env) projectVar() string {
	if p := e.getenv("DATASTORE_PROJECT_ID"); p != "" {
		return p
	}
	return e.getenv("GOOGLE_CLOUD_PROJECT")
}

// metadataRetry retries a metadata lookup that failed on the way (a
// refused connection, a 5xx): the server can lag an instance's start.
var metadataRetry = retry.Policy{Retries: 4, Base: 100 * time.Millisecond, Max: time.Second}

// errMetadataAnswer marks an answer that asking again will not change.
var errMetadataAnswer = errors.New("metadata server")

// metadataProject asks the metadata server for the project id.
func (e Env) metadataProject(ctx context.Context) (string, error) {
	u := e.MetadataURL
	if u == "" {
		u = MetadataProjectURL
		if h := e.getenv("GCE_METADATA_HOST"); h != "" {
			u = "http://" + h + "/computeMetadata/v1/project/project-id"
		}
	}
	timeout := e.MetadataTimeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// Never through a proxy: the server is link-local to the instance.
	client := &http.Client{Transport: &http.Transport{
		Proxy:       nil,
		DialContext: (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
	}}
	defer client.CloseIdleConnections()
	var project string
	err := metadataRetry.Do(ctx, func(int) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return fmt.Errorf("%w: %w", errMetadataAnswer, err)
		}
		req.Header.Set("Metadata-Flavor", "Google")
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(io.LimitReader(resp.Body, 1024))
		switch {
		case err != nil:
			return err
		case resp.StatusCode >= 500:
			return fmt.Errorf("GET %s: %s", u, resp.Status)
		case resp.StatusCode != http.StatusOK:
			return fmt.Errorf("%w: GET %s: %s", errMetadataAnswer, u, resp.Status)
		case resp.Header.Get("Metadata-Flavor") != "Google":
			// Something else answered the name (a proxy, a captive portal).
			return fmt.Errorf("%w: GET %s: the answer lacks Metadata-Flavor: Google", errMetadataAnswer, u)
		}
		project = strings.TrimSpace(string(body))
		if project == "" {
			return fmt.Errorf("%w: GET %s: an empty project id", errMetadataAnswer, u)
		}
		return nil
	}, func(err error) bool { return !errors.Is(err, errMetadataAnswer) })
	if err != nil {
		return "", err
	}
	return project, nil
}

// startupTimeout bounds the I/O a backend does at start-up.
const startupTimeout = 30 * time.Second

// redisBackend connects to REDIS_ADDR and checks that Redis answers.
func redisBackend(ctx context.Context, addr string) (store.Backend, error) {
	var client redis.UniversalClient
	if strings.HasPrefix(addr, "redis://") || strings.HasPrefix(addr, "rediss://") {
		opt, err := redis.ParseURL(addr)
		if err != nil {
			return nil, fmt.Errorf("REDIS_ADDR: %w", err)
		}
		client = redis.NewClient(opt)
	} else {
		// One address: a single node; several: a Cluster.
		client = redis.NewUniversalClient(&redis.UniversalOptions{Addrs: strings.Split(addr, ",")})
	}
	ctx, cancel := context.WithTimeout(ctx, startupTimeout)
	defer cancel()
	if err := client.Ping(ctx).Err(); err != nil {
		client.Close()
		return nil, fmt.Errorf("redis at %s: %w", addr, err)
	}
	return redislock.New(client)
}

// postgresMaxConns caps each instance's connections, so a fleet of
// instances stays within the server's max_connections.
const postgresMaxConns = 10

// postgresBackend opens POSTGRES_DSN and creates the table if missing.
func postgresBackend(ctx context.Context, dsn string) (store.Backend, error) {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, fmt.Errorf("POSTGRES_DSN: %w", err)
	}
	db.SetMaxOpenConns(postgresMaxConns)
	db.SetMaxIdleConns(postgresMaxConns)
	b, err := sqllock.New(db, sqllock.Postgres)
	if err != nil {
		db.Close()
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, startupTimeout)
	defer cancel()
	if err := b.EnsureSchema(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("postgres: creating the table: %w", err)
	}
	return b, nil
}

// Lease returns IDEMPOTENCY_LEASE, or store.DefaultLease.
func Lease() (time.Duration, error) {
	return leaseFrom(os.Getenv("IDEMPOTENCY_LEASE"))
}

func leaseFrom(v string) (time.Duration, error) {
	if v == "" {
		return store.DefaultLease, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("IDEMPOTENCY_LEASE=%q is not a positive duration", v)
	}
	return d, nil
}
