package idempotency_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The runnable example of each delivery path's page is an Example of
// this package, word for word, so that go test runs what the page shows
// (the pull module checks docs/pull.md's likewise).
func TestTheDocsRunnableExamplesAreExamples(t *testing.T) {
	for _, c := range []struct{ page, example, file string }{
		{"cloud-tasks.md", "ExampleTaskHandler", "example_tasks_test.go"},
		{"eventarc.md", "ExampleEventID", "example_eventarc_test.go"},
	} {
		t.Run(c.page, func(t *testing.T) {
			page, err := os.ReadFile(filepath.Join("docs", c.page))
			if err != nil {
				t.Fatal(err)
			}
			_, section, ok := strings.Cut(string(page), "\n## A runnable example\n")
			if !ok {
				t.Fatalf(`docs/%s has no section "A runnable example"`, c.page)
			}
			_, code, ok := strings.Cut(section, "```go\n")
			if !ok {
				t.Fatal("the section has no Go code block")
			}
			code, _, _ = strings.Cut(code, "```")
			if !strings.HasPrefix(code, "func "+c.example+"()") {
				t.Fatalf("the section's code is not %s:\n%s", c.example, code)
			}
			src, err := os.ReadFile(c.file)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(src), "\n"+code) {
				t.Fatalf("%s does not contain the page's code:\n%s", c.file, code)
			}
		})
	}
}
