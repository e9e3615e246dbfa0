// Package docstest keeps the Go code a documentation page shows equal to
// code that go test compiles and runs: a page's runnable example is an
// Example function of some package, word for word.
package docstest

import (
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// GoBlocks returns the bodies of the ```go code blocks of the section of
// the markdown file page whose heading line is heading ("## A runnable
// example"), from that line to the next heading of the same level or
// higher. It fails t when the page cannot be read, has no such section,
// or the section has no Go code block.
func GoBlocks(t testing.TB, page, heading string) []string {
	t.Helper()
	text, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(text), "\n"+heading+"\n")
	if !ok {
		t.Fatalf("%s has no section %q", page, heading)
	}
	level := strings.IndexByte(heading, ' ') // 2 for "## "
	if level < 1 || strings.Trim(heading[:level], "#") != "" {
		t.Fatalf("%q is not a markdown heading", heading)
	}
	next := regexp.MustCompile(fmt.Sprintf(`^#{1,%d} `, level))
	lines := strings.SplitAfter(section, "\n")
	fenced := false
	for i, l := range lines {
		if strings.HasPrefix(l, "```") {
			fenced = !fenced
		}
		if !fenced && next.MatchString(l) {
			section = strings.Join(lines[:i], "")
			break
		}
	}
	var blocks []string
	for {
		var code string
		_, code, ok = strings.Cut(section, "```go\n")
		if !ok {
			break
		}
		code, section, _ = strings.Cut(code, "```")
		blocks = append(blocks, code)
	}
	if len(blocks) == 0 {
		t.Fatalf("%s: the section %q has no Go code block", page, heading)
	}
	return blocks
}

// ShowsExample fails t unless the section heading of page shows the
// Example function example: one of its Go code blocks is that function
// (it starts "func example()"), and each of its Go code blocks is, word
// for word, part of one of files.
func ShowsExample(t testing.TB, page, heading, example string, files ...string) {
	t.Helper()
	blocks := GoBlocks(t, page, heading)
	if !slices.ContainsFunc(blocks, func(code string) bool { return strings.HasPrefix(code, "func "+example+"()") }) {
		t.Fatalf("%s: no Go code block of %q is %s", page, heading, example)
	}
	var srcs []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		srcs = append(srcs, string(b))
	}
next:
	for _, code := range blocks {
		for _, src := range srcs {
			if strings.Contains(src, "\n"+code) {
				continue next
			}
		}
		t.Errorf("%s: no file of %s contains this Go code block of %q:\n%s", page, strings.Join(files, ", "), heading, code)
	}
}
