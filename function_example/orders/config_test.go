package orders_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency"
	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/function_example/orders"
	"github.com/gcp-pubsub-idempotency/idempotency/internal/testsvc"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// metadataServer stands in for the metadata server: how it answers, and
// how many requests reached it.
type metadataServer struct {
	url  string
	hits *atomic.Int32
}

// The ways the stand-in metadata server answers.
const (
	mdUp        = "up"        // 200, Metadata-Flavor: Google, the project
	mdDown      = "down"      // nothing listens
	mdNotFound  = "404"       // a 404 from the server
	mdNoFlavor  = "no flavor" // 200 without Metadata-Flavor: something else answered
	mdEmpty     = "empty"     // 200 with an empty body
	mdHang      = "hang"      // accepts and never answers
	mdFlaky     = "flaky"     // a 503, then the project
	mdProjectID = "meta-proj" // the project it names
	mdTimeout   = time.Second // the lookup's bound in these tests
	mdNone      = ""          // no server: a lookup is a failure of the test
	mdWantPath  = "/computeMetadata/v1/project/project-id"
	mdFlavorHdr = "Metadata-Flavor"
)

// newMetadataServer starts a stand-in that answers as mode says. It
// refuses requests without the Metadata-Flavor: Google header or to
// another path, as the real one does.
func newMetadataServer(t *testing.T, mode string) metadataServer {
	t.Helper()
	hits := new(atomic.Int32)
	hang := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		if r.Header.Get(mdFlavorHdr) != "Google" || r.URL.Path != mdWantPath {
			http.Error(w, "missing Metadata-Flavor:Google header or wrong path", http.StatusForbidden)
			return
		}
		switch mode {
		case mdNotFound:
			w.Header().Set(mdFlavorHdr, "Google")
			http.NotFound(w, r)
			return
		case mdNoFlavor:
			fmt.Fprint(w, mdProjectID)
			return
		case mdHang:
			select {
			case <-hang:
			case <-r.Context().Done():
			}
			return
		case mdFlaky:
			if n == 1 {
				w.Header().Set(mdFlavorHdr, "Google")
				http.Error(w, "starting", http.StatusServiceUnavailable)
				return
			}
		}
		w.Header().Set(mdFlavorHdr, "Google")
		if mode != mdEmpty {
			fmt.Fprint(w, mdProjectID)
		}
	}))
	t.Cleanup(func() { close(hang); srv.Close() })
	url := srv.URL + mdWantPath
	if mode == mdDown {
		down := httptest.NewServer(http.NotFoundHandler())
		url = down.URL + mdWantPath
		down.Close()
	}
	return metadataServer{url: url, hits: hits}
}

// env is an Env over vars alone (never the process's environment) and
// the stand-in metadata server md (none: any lookup fails the test).
func env(t *testing.T, vars map[string]string, md metadataServer) orders.Env {
	url := md.url
	if url == "" {
		url = "http://metadata.invalid" + mdWantPath
	}
	return orders.Env{
		Getenv:          func(k string) string { return vars[k] },
		MetadataURL:     url,
		MetadataTimeout: mdTimeout,
	}
}

// Every combination of the variables, on and off Cloud Run, with the
// metadata server answering or not: the backend chosen, or the error and
// what it tells the operator to set; and whether the metadata server was
// asked at all (only on Cloud Run without a project variable).
func TestChooseBackendOnAndOffCloudRun(t *testing.T) {
	const (
		svc   = "orders"
		allow = orders.AllowMemoryOnCloudRun
	)
	ds := func(project, from string) orders.Choice {
		return orders.Choice{Kind: orders.Datastore, Project: project, ProjectFrom: from}
	}
	fromMetadata := ds(mdProjectID, "metadata server")
	memory := orders.Choice{Kind: orders.Memory}
	redisAt := orders.Choice{Kind: orders.Redis, RedisAddr: "10.0.0.3:6379"}
	pg := orders.Choice{Kind: orders.Postgres, PostgresDSN: "postgres://x"}
	// The refusal on Cloud Run names every way out.
	refusal := []string{"K_SERVICE=orders", "GOOGLE_CLOUD_PROJECT", "REDIS_ADDR", "POSTGRES_DSN"}
	memoryRefusal := []string{"IDEMPOTENCY_BACKEND=memory", "one instance", allow + "=true"}

	cases := []struct {
		name     string
		vars     map[string]string
		metadata string         // the stand-in's mode; mdNone: no lookup allowed
		want     orders.Choice  // zero when Choose must fail
		wantErr  []string       // what the error must say
		wantHits func(int) bool // requests that reached the stand-in
		errIsCtx bool           // the error wraps context.DeadlineExceeded
	}{
		// Off Cloud Run: the variables alone, memory when none is set.
		{name: "no variables", vars: map[string]string{}, want: memory},
		{name: "GOOGLE_CLOUD_PROJECT", vars: map[string]string{"GOOGLE_CLOUD_PROJECT": "p"}, want: ds("p", "GOOGLE_CLOUD_PROJECT")},
		{name: "DATASTORE_PROJECT_ID first", vars: map[string]string{"DATASTORE_PROJECT_ID": "d", "GOOGLE_CLOUD_PROJECT": "p"}, want: ds("d", "DATASTORE_PROJECT_ID")},
		{name: "REDIS_ADDR over a project", vars: map[string]string{"REDIS_ADDR": "10.0.0.3:6379", "GOOGLE_CLOUD_PROJECT": "p"}, want: redisAt},
		{name: "POSTGRES_DSN over a project", vars: map[string]string{"POSTGRES_DSN": "postgres://x", "GOOGLE_CLOUD_PROJECT": "p"}, want: pg},
		{name: "REDIS_ADDR and POSTGRES_DSN", vars: map[string]string{"REDIS_ADDR": "10.0.0.3:6379", "POSTGRES_DSN": "postgres://x"},
			wantErr: []string{"IDEMPOTENCY_BACKEND=redis or postgres"}},
		{name: "both, postgres chosen", vars: map[string]string{"REDIS_ADDR": "10.0.0.3:6379", "POSTGRES_DSN": "postgres://x", "IDEMPOTENCY_BACKEND": "postgres"}, want: pg},
		{name: "explicit datastore over REDIS_ADDR", vars: map[string]string{"REDIS_ADDR": "10.0.0.3:6379", "GOOGLE_CLOUD_PROJECT": "p", "IDEMPOTENCY_BACKEND": "datastore"}, want: ds("p", "GOOGLE_CLOUD_PROJECT")},
		{name: "explicit memory over REDIS_ADDR", vars: map[string]string{"REDIS_ADDR": "10.0.0.3:6379", "IDEMPOTENCY_BACKEND": "memory"}, want: memory},
		{name: "explicit redis without REDIS_ADDR", vars: map[string]string{"IDEMPOTENCY_BACKEND": "redis"}, wantErr: []string{"REDIS_ADDR"}},
		{name: "explicit postgres without POSTGRES_DSN", vars: map[string]string{"IDEMPOTENCY_BACKEND": "postgres"}, wantErr: []string{"POSTGRES_DSN"}},
		{name: "unknown backend", vars: map[string]string{"IDEMPOTENCY_BACKEND": "mysql", "POSTGRES_DSN": "postgres://x"}, wantErr: []string{`"mysql"`}},
		// Off Cloud Run the metadata server is never asked, even when it
		// would answer: a workstation has none.
		{name: "explicit datastore without a project, off Cloud Run", vars: map[string]string{"IDEMPOTENCY_BACKEND": "datastore"}, metadata: mdUp,
			wantErr: []string{"GOOGLE_CLOUD_PROJECT"}, wantHits: none},
		{name: "the override alone, off Cloud Run", vars: map[string]string{allow: "true"}, metadata: mdUp, want: memory, wantHits: none},

		// On Cloud Run: a project variable or a shared store needs no lookup.
		{name: "Cloud Run, GOOGLE_CLOUD_PROJECT", vars: map[string]string{"K_SERVICE": svc, "GOOGLE_CLOUD_PROJECT": "p"}, metadata: mdUp,
			want: ds("p", "GOOGLE_CLOUD_PROJECT"), wantHits: none},
		{name: "Cloud Run, DATASTORE_PROJECT_ID", vars: map[string]string{"K_SERVICE": svc, "DATASTORE_PROJECT_ID": "d"}, metadata: mdDown,
			want: ds("d", "DATASTORE_PROJECT_ID"), wantHits: none},
		{name: "Cloud Run, REDIS_ADDR", vars: map[string]string{"K_SERVICE": svc, "REDIS_ADDR": "10.0.0.3:6379"}, metadata: mdDown, want: redisAt, wantHits: none},
		{name: "Cloud Run, POSTGRES_DSN", vars: map[string]string{"K_SERVICE": svc, "POSTGRES_DSN": "postgres://x"}, metadata: mdDown, want: pg, wantHits: none},
		{name: "Cloud Run, explicit redis without REDIS_ADDR", vars: map[string]string{"K_SERVICE": svc, "IDEMPOTENCY_BACKEND": "redis"}, metadata: mdUp,
			wantErr: []string{"REDIS_ADDR"}, wantHits: none},
		// On Cloud Run without a project: the metadata server's, or no start.
		{name: "Cloud Run, no variables, metadata answers", vars: map[string]string{"K_SERVICE": svc}, metadata: mdUp, want: fromMetadata, wantHits: once},
		{name: "Cloud Run, explicit datastore, metadata answers", vars: map[string]string{"K_SERVICE": svc, "IDEMPOTENCY_BACKEND": "datastore"}, metadata: mdUp,
			want: fromMetadata, wantHits: once},
		{name: "Cloud Run, metadata answers after a 503", vars: map[string]string{"K_SERVICE": svc}, metadata: mdFlaky, want: fromMetadata,
			wantHits: func(n int) bool { return n == 2 }},
		{name: "Cloud Run, no variables, metadata down", vars: map[string]string{"K_SERVICE": svc}, metadata: mdDown, wantErr: refusal},
		{name: "Cloud Run, explicit datastore, metadata down", vars: map[string]string{"K_SERVICE": svc, "IDEMPOTENCY_BACKEND": "datastore"}, metadata: mdDown, wantErr: refusal},
		{name: "Cloud Run, metadata 404, asked once", vars: map[string]string{"K_SERVICE": svc}, metadata: mdNotFound, wantErr: append(refusal, "404"), wantHits: once},
		{name: "Cloud Run, an answer without Metadata-Flavor", vars: map[string]string{"K_SERVICE": svc}, metadata: mdNoFlavor,
			wantErr: append(refusal, "Metadata-Flavor"), wantHits: once},
		{name: "Cloud Run, an empty project id", vars: map[string]string{"K_SERVICE": svc}, metadata: mdEmpty, wantErr: append(refusal, "empty"), wantHits: once},
		{name: "Cloud Run, metadata never answers", vars: map[string]string{"K_SERVICE": svc}, metadata: mdHang, wantErr: refusal, errIsCtx: true},
		{name: "Cloud Run, the override alone does not choose memory", vars: map[string]string{"K_SERVICE": svc, allow: "true"}, metadata: mdUp,
			want: fromMetadata, wantHits: once},
		{name: "Cloud Run, the override alone, metadata down", vars: map[string]string{"K_SERVICE": svc, allow: "true"}, metadata: mdDown, wantErr: refusal},
		// An explicit memory on Cloud Run: only with the override.
		{name: "Cloud Run, explicit memory", vars: map[string]string{"K_SERVICE": svc, "IDEMPOTENCY_BACKEND": "memory"}, metadata: mdUp,
			wantErr: memoryRefusal, wantHits: none},
		{name: "Cloud Run, explicit memory, override false", vars: map[string]string{"K_SERVICE": svc, "IDEMPOTENCY_BACKEND": "memory", allow: "false"},
			metadata: mdUp, wantErr: memoryRefusal, wantHits: none},
		{name: "Cloud Run, explicit memory, override not a bool", vars: map[string]string{"K_SERVICE": svc, "IDEMPOTENCY_BACKEND": "memory", allow: "yes"},
			metadata: mdUp, wantErr: []string{allow, `"yes"`}, wantHits: none},
		{name: "Cloud Run, explicit memory, override true", vars: map[string]string{"K_SERVICE": svc, "IDEMPOTENCY_BACKEND": "memory", allow: "true"},
			metadata: mdUp, want: memory, wantHits: none},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var md metadataServer
			if c.metadata != mdNone {
				md = newMetadataServer(t, c.metadata)
			}
			got, err := env(t, c.vars, md).Choose(t.Context())
			if c.wantErr == nil {
				if err != nil || got != c.want {
					t.Fatalf("%v: %+v, %v; want %+v", c.vars, got, err, c.want)
				}
			} else {
				if err == nil {
					t.Fatalf("%v: chose %+v, want an error saying %q", c.vars, got, c.wantErr)
				}
				for _, s := range c.wantErr {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("%v: error %q does not say %q", c.vars, err, s)
					}
				}
				if c.errIsCtx && !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("error %v does not wrap context.DeadlineExceeded", err)
				}
			}
			if c.wantHits != nil {
				if n := int(md.hits.Load()); !c.wantHits(n) {
					t.Errorf("the metadata server was asked %d times", n)
				}
			}
		})
	}
}

func none(n int) bool { return n == 0 }
func once(n int) bool { return n == 1 }

// GCE_METADATA_HOST, which Google's client libraries read, moves the
// metadata server for the lookup too.
func TestChooseAsksTheMetadataServerAtGCEMetadataHost(t *testing.T) {
	md := newMetadataServer(t, mdUp)
	host := strings.TrimSuffix(strings.TrimPrefix(md.url, "http://"), mdWantPath)
	e := orders.Env{Getenv: func(k string) string {
		return map[string]string{"K_SERVICE": "orders", "GCE_METADATA_HOST": host}[k]
	}}
	got, err := e.Choose(t.Context())
	if err != nil || got.Project != mdProjectID || got.ProjectFrom != "metadata server" || md.hits.Load() != 1 {
		t.Fatalf("%+v, %v after %d requests; want project %s from the metadata server", got, err, md.hits.Load(), mdProjectID)
	}
}

// The lookup ends with the caller's context, not only with its own bound.
func TestChooseMetadataLookupEndsWithTheContext(t *testing.T) {
	md := newMetadataServer(t, mdHang)
	e := env(t, map[string]string{"K_SERVICE": "orders"}, md)
	e.MetadataTimeout = time.Hour
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := e.Choose(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("%v, want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("Choose returned %v after its context ended", d)
	}
}

// What cmd/local's -backend flag gets: each kind from its own variable,
// never from IDEMPOTENCY_BACKEND, K_SERVICE or the metadata server.
func TestNamedBackendReadsOnlyItsOwnSetting(t *testing.T) {
	all := map[string]string{
		"IDEMPOTENCY_BACKEND": "datastore", "K_SERVICE": "orders", "GOOGLE_CLOUD_PROJECT": "p",
		"REDIS_ADDR": "10.0.0.3:6379", "POSTGRES_DSN": "postgres://x",
	}
	cases := []struct {
		kind    string
		vars    map[string]string
		want    orders.Choice
		wantErr string
	}{
		{"memory", all, orders.Choice{Kind: orders.Memory}, ""},
		{"memory", map[string]string{}, orders.Choice{Kind: orders.Memory}, ""},
		{"redis", all, orders.Choice{Kind: orders.Redis, RedisAddr: "10.0.0.3:6379"}, ""},
		{"postgres", all, orders.Choice{Kind: orders.Postgres, PostgresDSN: "postgres://x"}, ""},
		{"datastore", all, orders.Choice{Kind: orders.Datastore, Project: "p", ProjectFrom: "GOOGLE_CLOUD_PROJECT"}, ""},
		{"redis", map[string]string{}, orders.Choice{}, "REDIS_ADDR"},
		{"postgres", map[string]string{}, orders.Choice{}, "POSTGRES_DSN"},
		{"datastore", map[string]string{"K_SERVICE": "orders"}, orders.Choice{}, "GOOGLE_CLOUD_PROJECT"},
		{"", all, orders.Choice{}, "want datastore, redis, postgres or memory"},
		{"sqlite", all, orders.Choice{}, "want datastore, redis, postgres or memory"},
	}
	for _, c := range cases {
		got, err := env(t, c.vars, metadataServer{}).Named(c.kind)
		switch {
		case c.wantErr == "" && (err != nil || got != c.want):
			t.Errorf("Named(%q) over %v: %+v, %v; want %+v", c.kind, c.vars, got, err, c.want)
		case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
			t.Errorf("Named(%q) over %v: %+v, %v; want an error saying %q", c.kind, c.vars, got, err, c.wantErr)
		}
	}
}

func TestSetupReadsTheLease(t *testing.T) {
	for v, want := range map[string]time.Duration{"": store.DefaultLease, "90s": 90 * time.Second} {
		b, lease, err := env(t, map[string]string{"IDEMPOTENCY_LEASE": v}, metadataServer{}).Setup(t.Context())
		if err != nil || lease != want {
			t.Fatalf("IDEMPOTENCY_LEASE=%q: lease %v, %v; want %v", v, lease, err, want)
		}
		if _, ok := b.(*fake.Store); !ok {
			t.Fatalf("backend %T off Cloud Run without a setting, want the in-memory store", b)
		}
	}
	for _, bad := range []string{"soon", "-1s", "0"} {
		if _, _, err := env(t, map[string]string{"IDEMPOTENCY_LEASE": bad}, metadataServer{}).Setup(t.Context()); err == nil {
			t.Errorf("IDEMPOTENCY_LEASE=%q accepted", bad)
		}
	}
}

// On Cloud Run with nothing configured and no metadata server, Setup
// returns no backend at all: the function's init then fails the start.
func TestSetupOnCloudRunWithoutAProjectRefusesToStart(t *testing.T) {
	for _, vars := range []map[string]string{
		{"K_SERVICE": "orders"},
		{"K_SERVICE": "orders", "IDEMPOTENCY_BACKEND": "memory"},
	} {
		b, _, err := env(t, vars, newMetadataServer(t, mdDown)).Setup(t.Context())
		if err == nil || b != nil {
			t.Fatalf("%v: Setup gave %T, %v; want no backend and an error", vars, b, err)
		}
	}
}

// On Cloud Run without a project variable, the project the metadata
// server names is the one whose Datastore keeps the records: two instances
// set up that way share them, and a key's body runs once.
func TestSetupOnCloudRunUsesDatastoreInTheMetadataServersProject(t *testing.T) {
	clearBackendEnv(t)
	testsvc.Datastore(t) // sets DATASTORE_EMULATOR_HOST, which datastorelock.Dial reads
	project := fmt.Sprintf("orders-test-%d", time.Now().UnixNano())
	hits := new(atomic.Int32)
	md := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		if r.Header.Get(mdFlavorHdr) != "Google" || r.URL.Path != mdWantPath {
			http.Error(w, "forbidden", http.StatusForbidden)
			return
		}
		w.Header().Set(mdFlavorHdr, "Google")
		fmt.Fprint(w, project)
	}))
	defer md.Close()
	e := orders.Env{
		Getenv:      func(k string) string { return map[string]string{"K_SERVICE": "orders"}[k] },
		MetadataURL: md.URL + mdWantPath,
	}
	key := fmt.Sprintf("orders-test:%d", time.Now().UnixNano())
	runs := 0
	for i := range 2 {
		b, _, err := e.Setup(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := b.(*datastorelock.Backend); !ok {
			t.Fatalf("backend %T, want Datastore", b)
		}
		err = idempotency.Lock(t.Context(), b, key, func(context.Context) error { runs++; return nil })
		if want := i == 1; errors.Is(err, idempotency.ErrDuplicate) != want || (!want && err != nil) {
			t.Fatalf("instance %d: %v", i+1, err)
		}
	}
	if runs != 1 || hits.Load() != 2 {
		t.Fatalf("the body ran %d times (want 1); the metadata server was asked %d times (want 2)", runs, hits.Load())
	}
}
