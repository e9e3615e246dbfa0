package pull_test

import (
	"path/filepath"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/docstest"
)

// docs/pull.md's runnable example is ExampleHandler, as it is in
// example_test.go: the example the page shows compiles and runs.
func TestTheDocsExampleIsExampleHandler(t *testing.T) {
	docstest.ShowsExample(t, filepath.Join("..", "docs", "pull.md"), "## A runnable example", "ExampleHandler", "example_test.go")
}
