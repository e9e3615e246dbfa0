package sqllock

// NowSQL is the dialect's expression of the database's now in epoch
// milliseconds, for tests that evaluate it at a pinned instant.
func NowSQL(d *Dialect) string { return d.now }
