// Package testsvc starts the real services the backend tests run against,
// on free loopback ports, or points at the ones the environment names.
//
// Starting a server is one call. A test that can share a server with the
// rest of its test binary asks for its address or DSN:
//
//	addr := testsvc.Redis(t)      // REDIS_ADDR, or a redis-server it starts
//	dsn := testsvc.Postgres(t)    // POSTGRES_DSN, or a postgres it starts
//	dsn := testsvc.MariaDB(t)     // MYSQL_DSN, or a mariadbd it starts
//	host := testsvc.Datastore(t)  // DATASTORE_EMULATOR_HOST, or the emulator
//	host := testsvc.PubSub(t)     // PUBSUB_EMULATOR_HOST, or the emulator
//
// A test that kills, restarts or reconfigures its server gets one of its
// own, stopped when the test ends: [StartRedis], [StartRedisCluster],
// [StartPostgres], [StartMariaDB], [StartMariaDBInZone]. A test that jumps
// its server's wall clock gets a server started under libfaketime, one test
// at a time: [PostgresOnFakeClock], [MariaDBOnFakeClock]. A package whose
// tests use the shared servers calls [StopAll] from TestMain after m.Run.
//
// A service that is neither named nor installed skips the test with a
// message saying how to get it, except when [Required] reports true (CI=true,
// or IDEMPOTENCY_REQUIRE_SERVICES=1 as `make test` sets): then it fails the
// test, so that no backend passes by being skipped.
//
// [DropProxy] loses replies and cuts connections between a backend and its
// server (it implements storetest.Faults), and [RaceProcesses] races claims
// from two processes.
package testsvc
