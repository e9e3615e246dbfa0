// Package enginetest tests package sqllock on real engines: PostgreSQL and
// MariaDB servers that internal/testsvc starts, and SQLite files. It has
// no code of its own, only tests, and it is a module of its own so that
// the SQL drivers the tests need (pgx, go-sql-driver/mysql, modernc
// SQLite) stay out of the sqllock module's go.mod: a user of sqllock picks
// their own driver and gets no other in their module graph.
package enginetest
