package enginetest

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/gcp-pubsub-idempotency/idempotency/store"
	"github.com/gcp-pubsub-idempotency/idempotency/store/sqllock"
)

// The verbs' rules under the strictest isolation a user may set as the
// session default: racing claims on an expired Done key admit at most one
// winner (with the next fence), never answer AlreadyDone for it, and a
// serialization failure surfaces at worst as an error, never as a wrong
// outcome.
func TestRacingClaimsAdmitAtMostOneUnderSerializableIsolation(t *testing.T) {
	eachEngine(t, networked, func(t *testing.T, e engine) {
		const (
			ttl    = 100 * time.Millisecond
			racers = 12
			rounds = 8
		)
		dsn := e.dsn(t)
		sep := "?"
		if strings.Contains(dsn, "?") {
			sep = "&"
		}
		if e.name == "postgres" {
			dsn += sep + "default_transaction_isolation=serializable"
		} else {
			dsn += sep + "tx_isolation=%27SERIALIZABLE%27"
		}
		db := e.open(t, dsn, nil)
		var level string
		q := "SHOW default_transaction_isolation"
		if e.name == "mysql" {
			q = "SELECT @@tx_isolation"
		}
		if err := db.QueryRow(q).Scan(&level); err != nil || !strings.EqualFold(strings.ReplaceAll(level, "-", " "), "serializable") {
			t.Fatalf("isolation %q %v, want serializable", level, err)
		}
		b := e.backend(t, db, sqllock.WithTTL(ttl))
		for round := range rounds {
			key := fmt.Sprint("serializable-", round)
			done := completedAndExpired(t, b, key)
			results, errs := raceClaims(t, b, key, racers, time.Minute)
			won, failed := 0, 0
			for i, res := range results {
				switch {
				case errs[i] != nil:
					failed++
				case res.Outcome == store.Won:
					won++
					if res.Claim.Fence != done.Fence+1 {
						t.Errorf("round %d: won fence %d, want %d", round, res.Claim.Fence, done.Fence+1)
					}
				case res.Outcome != store.HeldByOther:
					t.Errorf("round %d: %v until %v for an expired done key", round, res.Outcome, res.Until)
				}
			}
			if won > 1 {
				t.Errorf("round %d: %d racers won", round, won)
			}
			if won == 0 && failed == 0 {
				t.Errorf("round %d: nobody won and nobody failed", round)
			}
			if failed > 0 {
				t.Logf("round %d: %d of %d racers failed (%v)", round, failed, racers, errs)
			}
		}
	})
}
