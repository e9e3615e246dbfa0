package pull_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// docs/pull.md's runnable example is ExampleHandler, as it is in
// example_test.go: the example the page shows compiles and runs.
func TestTheDocsExampleIsExampleHandler(t *testing.T) {
	page, err := os.ReadFile(filepath.Join("..", "docs", "pull.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(page), "\n## A runnable example\n")
	if !ok {
		t.Fatal(`docs/pull.md has no section "A runnable example"`)
	}
	_, code, ok := strings.Cut(section, "```go\n")
	if !ok {
		t.Fatal("the section has no Go code block")
	}
	code, _, _ = strings.Cut(code, "```")
	if !strings.HasPrefix(code, "func ExampleHandler()") {
		t.Fatalf("the section's code is not ExampleHandler:\n%s", code)
	}
	examples, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(examples), "\n"+code) {
		t.Fatalf("example_test.go does not contain the page's code:\n%s", code)
	}
}
