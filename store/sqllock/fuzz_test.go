package sqllock

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"

	_ "modernc.org/sqlite"
)

// plainIdent is the rule New must enforce, written out byte by byte rather
// than as the regexp New uses: ASCII letters, digits and underscores, not
// starting with a digit, 1 to 63 bytes. Such a name never needs quoting
// for its characters and fits every engine whole.
func plainIdent(s string) bool {
	if len(s) == 0 || len(s) > maxIdent {
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
// that is itself plain and differs from the table's; SQLite must run the
// DDL.
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
	db, err := sql.Open("sqlite", "file::memory:")
	if err != nil {
		f.Fatal(err)
	}
	db.SetMaxOpenConns(1) // one connection: one in-memory database
	f.Cleanup(func() { db.Close() })

	f.Fuzz(func(t *testing.T, name string) {
		b, err := New(db, SQLite, WithTable(name))
		if plain := plainTable(name); (err == nil) != plain {
			t.Fatalf("New(WithTable(%q)): err = %v; the name is plain: %v", name, err, plain)
		}
		if err != nil {
			return
		}
		parts := strings.Split(name, ".")
		table := parts[len(parts)-1]
		idx := indexName(table)
		if !plainIdent(idx) || idx == table {
			t.Fatalf("table %q: index name %q (%d bytes) is not plain or equals the table's", name, idx, len(idx))
		}
		for _, d := range []*Dialect{Postgres, MySQL, SQLite} {
			ddl := d.render(name).schema1
			q := d.quote("")[:1]
			all := strings.Join(d.schema, "\n")
			refs := strings.Count(all, "{T}") + strings.Count(all, "{SI}")
			want := 2 * (refs*len(parts) + strings.Count(all, "{TN}") + strings.Count(all, "{I}"))
			if got := strings.Count(ddl, q); got != want {
				t.Fatalf("%s DDL for %q holds %d quote characters, want %d:\n%s", d, name, got, want, ddl)
			}
			if !strings.Contains(ddl, d.quote(idx)) {
				t.Fatalf("%s DDL for %q does not name the index %q:\n%s", d, name, idx, ddl)
			}
		}
		if len(parts) == 2 && parts[0] != "main" {
			return // SQLite knows no other schema here
		}
		// Running the DDL is what makes an execution slow: run it once per
		// shape of name (parts, table length, first byte's class), which is
		// all the DDL can depend on once the characters are plain.
		shape := fmt.Sprint(len(parts), len(table), table[0] == '_', table[0] >= 'a')
		if _, done := ranDDL.LoadOrStore(shape, true); done {
			return
		}
		ctx := context.Background()
		if err := b.EnsureSchema(ctx); err != nil {
			t.Fatalf("EnsureSchema(%q): %v", name, err)
		}
		if _, err := db.ExecContext(ctx, "DROP TABLE "+SQLite.quote(table)); err != nil {
			t.Fatalf("DROP TABLE %q: %v", table, err)
		}
	})
}

// ranDDL holds the shapes of name whose DDL FuzzTableName has run.
var ranDDL sync.Map

func TestIndexNamesAtTheLimit(t *testing.T) {
	seen := map[string]string{}
	for n := 1; n <= maxIdent; n++ {
		for _, last := range "ab" {
			table := strings.Repeat("t", n-1) + string(last)
			idx := indexName(table)
			if !plainIdent(idx) || idx == table {
				t.Fatalf("table of %d: index %q", n, idx)
			}
			if other, ok := seen[idx]; ok {
				t.Fatalf("tables %q and %q share the index name %q", other, table, idx)
			}
			seen[idx] = table
			if n+len("_expires_at") <= maxIdent && idx != table+"_expires_at" {
				t.Fatalf("table of %d: index %q, want the name earlier versions created", n, idx)
			}
		}
	}
}

type sqlStateErr string

func (e sqlStateErr) Error() string    { return "server said " + string(e) }
func (e sqlStateErr) SQLState() string { return string(e) }

func TestMayHaveLanded(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{io.ErrUnexpectedEOF, true},
		{errors.New("invalid connection"), true},
		{fmt.Errorf("write: %w", errors.New("broken pipe")), true},
		{driver.ErrBadConn, false},
		{sqlStateErr("40P01"), false},
		{fmt.Errorf("wrapped: %w", sqlStateErr("40001")), false},
		{errors.New("Error 1213 (40001): Deadlock found when trying to get lock"), false},
		{errors.New("Error 1205 (HY000): Lock wait timeout exceeded"), false},
		{errors.New("Error 4031 (HY000): The client was disconnected by the server"), false},
	} {
		if got := mayHaveLanded(c.err); got != c.want {
			t.Errorf("mayHaveLanded(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
