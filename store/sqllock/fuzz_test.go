package sqllock_test

import (
	"strings"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/store/internal/dialect"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// plainIdent is the rule New must enforce, written out byte by byte rather
// than as the regexp New uses: ASCII letters, digits and underscores, not
// starting with a digit, 1 to 63 bytes. Such a name never needs quoting
// for its characters and fits every engine whole.
func plainIdent(s string) bool {
	if len(s) == 0 || len(s) > dialect.MaxIdent {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '_', 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z':
		case '0' <= c && c <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}

// plainTable: table or schema.table, each part a plainIdent.
func plainTable(s string) bool {
	parts := strings.Split(s, ".")
	if len(parts) > 2 {
		return false
	}
	for _, p := range parts {
		if !plainIdent(p) {
			return false
		}
	}
	return true
}

// FuzzTableName feeds New arbitrary table names. New must never panic, must
// accept exactly the plain names (so none that would need quoting for its
// characters, none longer than an engine keeps whole), and for an accepted
// name every dialect's DDL must quote exactly the table and an index name
// that is itself plain and differs from the table's. (That each engine
// runs the DDL, for every shape of name, is enginetest's
// TestEnsureSchemaForEveryShapeOfTableName.)
func FuzzTableName(f *testing.F) {
	for _, s := range []string{
		// The hostile names TestNewRefusesHostileTableNames refuses.
		"t; DROP TABLE users; --", `t"x`, "t`x", "t'x", "tàble", "has space", "1starts_with_digit",
		"a.b.c", "", ".t", "t.", strings.Repeat("x", 64),
		// And the ones it accepts.
		"idempotency_keys", "_t", "Orders2", "app.idempotency_keys", strings.Repeat("x", 63),
		// Near the limits and the quoting characters.
		strings.Repeat("y", 52), strings.Repeat("y", 53), strings.Repeat("y", 54),
		"main." + strings.Repeat("z", 63), "t\x00", "t\n", "t]", "[t]", "t\\", "t--", "t/*", "t$1", "t?",
		"\xff", "ﬁ", "\u212a", // KELVIN SIGN, which lower-cases to ASCII k
	} {
		f.Add(s)
	}
	db := noDB(f)
	f.Fuzz(func(t *testing.T, name string) {
		_, err := sqllock.New(db, sqllock.SQLite, sqllock.WithTable(name))
		if plain := plainTable(name); (err == nil) != plain {
			t.Fatalf("New(WithTable(%q)): err = %v; the name is plain: %v", name, err, plain)
		}
		if err != nil {
			return
		}
		parts := strings.Split(name, ".")
		table := parts[len(parts)-1]
		idx := dialect.IndexName(table)
		if !plainIdent(idx) || idx == table {
			t.Fatalf("table %q: index name %q (%d bytes) is not plain or equals the table's", name, idx, len(idx))
		}
		for d, sq := range dialects {
			b, err := sqllock.New(db, d, sqllock.WithTable(name))
			if err != nil {
				t.Fatalf("%s: New(WithTable(%q)): %v", d, name, err)
			}
			ddl := b.Schema()
			if want := sq.Render(name).Schema1; ddl != want {
				t.Fatalf("%s: Schema() for %q is not its dialect's DDL:\n%s\nwant\n%s", d, name, ddl, want)
			}
			q := sq.Quote("")[:1]
			all := strings.Join(sq.Schema, "\n")
			refs := strings.Count(all, "{T}") + strings.Count(all, "{SI}")
			want := 2 * (refs*len(parts) + strings.Count(all, "{TN}") + strings.Count(all, "{I}"))
			if got := strings.Count(ddl, q); got != want {
				t.Fatalf("%s DDL for %q holds %d quote characters, want %d:\n%s", d, name, got, want, ddl)
			}
			if !strings.Contains(ddl, sq.Quote(idx)) {
				t.Fatalf("%s DDL for %q does not name the index %q:\n%s", d, name, idx, ddl)
			}
		}
	})
}

// dialects is each Dialect with the SQL it stands for.
var dialects = map[sqllock.Dialect]*dialect.SQL{
	sqllock.Postgres: dialect.Postgres(),
	sqllock.MySQL:    dialect.MySQL(),
	sqllock.SQLite:   dialect.SQLite(),
}

func TestIndexNamesAtTheLimit(t *testing.T) {
	seen := map[string]string{}
	for n := 1; n <= dialect.MaxIdent; n++ {
		for _, last := range "ab" {
			table := strings.Repeat("t", n-1) + string(last)
			idx := dialect.IndexName(table)
			if !plainIdent(idx) || idx == table {
				t.Fatalf("table of %d: index %q", n, idx)
			}
			if other, ok := seen[idx]; ok {
				t.Fatalf("tables %q and %q share the index name %q", other, table, idx)
			}
			seen[idx] = table
			if n+len("_expires_at") <= dialect.MaxIdent && idx != table+"_expires_at" {
				t.Fatalf("table of %d: index %q, want the name earlier versions created", n, idx)
			}
		}
	}
}
