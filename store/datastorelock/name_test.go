package datastorelock_test

import (
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/doclock/doclocktest"
	"github.com/gcp-pubsub-idempotency/idempotency/store/datastorelock"
)

// names is the mapping of keys to Datastore entity names: a name may hold
// any character, "/" included (only the shared rules apply).
var names = doclocktest.Names{
	Service: "Datastore",
	Name:    datastorelock.Name,
	KeyOf:   datastorelock.KeyOf,
	Invalid: func(string) string { return "" },
	Want:    map[string]string{"ключ/鍵 x": "ключ/鍵 x"},
}

func FuzzName(f *testing.F) { names.Fuzz(f) }

func TestNames(t *testing.T) { names.Run(t) }
