package docstest

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
)

const page = "# Title\n\n## Before\n\n```go\nfunc before() {}\n```\n\n" +
	"## A runnable example\n\nText.\n\n```sh\n# a shell comment, not a heading\ngo test\n```\n\n" +
	"```go\nfunc ExampleX() {\n\t// Output:\n}\n```\n\n### A subsection\n\n```go\nvar helper = 1\n```\n\n" +
	"## After\n\n```go\nfunc after() {}\n```\n"

func write(t *testing.T, name, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// The section runs from its heading to the next heading of its level or
// higher: a subsection's blocks are in it, a "#" line in a code block
// ends nothing, the sections around it are out.
func TestGoBlocksAreTheSectionsOwn(t *testing.T) {
	got := GoBlocks(t, write(t, "page.md", page), "## A runnable example")
	want := []string{"func ExampleX() {\n\t// Output:\n}\n", "var helper = 1\n"}
	if !slices.Equal(got, want) {
		t.Fatalf("GoBlocks = %q, want %q", got, want)
	}
}

// recorder is a testing.TB that keeps what ShowsExample reports.
type recorder struct {
	testing.TB
	errs []string
}

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}
func (r *recorder) Fatalf(format string, args ...any) {
	r.Errorf(format, args...)
	runtime.Goexit()
}

// run calls ShowsExample as t would, and returns what it reported.
func run(page, example string, files ...string) []string {
	r := &recorder{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		ShowsExample(r, page, "## A runnable example", example, files...)
	}()
	<-done
	return r.errs
}

// ShowsExample passes a page whose blocks are in the files, and fails one
// that shows another function, or a block that differs from the source
// by one character.
func TestShowsExampleFailsWhenThePageDiffers(t *testing.T) {
	p := write(t, "page.md", page)
	src := write(t, "example_test.go", "package x\n\nfunc ExampleX() {\n\t// Output:\n}\n")
	helper := write(t, "helper.go", "package x\n\nvar helper = 1\n")
	if errs := run(p, "ExampleX", src, helper); len(errs) != 0 {
		t.Fatalf("the page shows ExampleX and helper, yet: %q", errs)
	}
	if errs := run(p, "ExampleY", src, helper); len(errs) != 1 || !strings.Contains(errs[0], "is ExampleY") {
		t.Errorf("a page without ExampleY: %q", errs)
	}
	if errs := run(p, "ExampleX", src); len(errs) != 1 || !strings.Contains(errs[0], "var helper = 1") {
		t.Errorf("a block in no file: %q", errs)
	}
	changed := write(t, "changed_test.go", "package x\n\nfunc ExampleX() {\n\t// Output: \n}\n")
	if errs := run(p, "ExampleX", changed, helper); len(errs) != 1 {
		t.Errorf("a source that differs from the page: %q", errs)
	}
}
