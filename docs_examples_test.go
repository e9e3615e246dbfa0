package idempotency_test

import (
	"path/filepath"
	"testing"

	"github.com/gcp-pubsub-idempotency/idempotency/internal/docstest"
)

// The runnable example of each delivery path's page is an Example of
// this package, word for word, so that go test runs what the page shows
// (the pull module checks docs/pull.md's likewise, and the pgxlock module
// docs/effects.md's sqlc example).
func TestTheDocsRunnableExamplesAreExamples(t *testing.T) {
	for _, c := range []struct{ page, example, file string }{
		{"cloud-tasks.md", "ExampleTaskHandler", "example_tasks_test.go"},
		{"eventarc.md", "ExampleEventID", "example_eventarc_test.go"},
	} {
		t.Run(c.page, func(t *testing.T) {
			docstest.ShowsExample(t, filepath.Join("docs", c.page), "## A runnable example", c.example, c.file)
		})
	}
}
