package fake

// InProcess reports true: a Store keeps its records in this process's
// memory, so it de-duplicates only the deliveries that reach this
// process. The idempotency wrappers (Idempotent, PushHandler and their Tx
// forms) log a warning when they are built on such a backend in a Cloud
// Run service or a Cloud Run function (the K_SERVICE environment variable
// set), where instances come and go and each has its own.
func (s *Store) InProcess() bool { return true }
