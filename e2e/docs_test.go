package e2e

// The docs promise that every command they show works. These tests read
// README.md and docs/*.md and check each command in a shell code block
// (info string sh, bash, shell or console), and each `gcloud ...` or
// `make ...` in inline code, in one of five ways:
//
//   - go get: run in a scratch module that replaces every module of this
//     checkout (GOWORK=off, GOFLAGS=-mod=mod), then a program importing
//     what was got is built there;
//   - go install, go mod tidy, go build ./...: only in the README's Install
//     and Quickstart sections, which internal/release's
//     TestReleaseIsUsableFromAModuleProxy runs as written against a release
//     served from a module proxy on disk;
//   - go test: the package patterns must resolve and the -run / -bench
//     patterns must select at least one test, benchmark or fuzz target in
//     them (CI runs every test of every module: make test);
//   - make: `make demo` and `make function-source` are run and their output
//     checked; `make test` must be what .ci/run runs; any other target must
//     exist and be covered: a prerequisite of test, a script that test's
//     recipe runs too, or go test lines checked as above;
//   - gcloud: cannot run without Google Cloud, so the command group must be a
//     command (not a group) of the local SDK, every --flag must appear in
//     its --help, and it must be given as many positional arguments as its
//     --help requires without a prompt. Without gcloud this is skipped, unless
//     IDEMPOTENCY_REQUIRE_SERVICES is set.
//
// Anything else fails the test, so a new command cannot enter the docs
// unchecked. Relative links must point at existing files and headings, test
// names in the docs must exist, and the README must stay within 12 KiB.

import (
	"bufio"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// maxReadme is the README's budget: a newcomer reads it in five minutes.
const maxReadme = 12 << 10

// docFile is one markdown file of the docs, relative to the repository.
type docFile struct {
	path string // e.g. "docs/deploy.md"
	text string
}

// docCommand is one command the docs show.
type docCommand struct {
	where  string // file:line
	text   string // the command line, continuations joined
	inline bool   // from an inline code span rather than a code block
}

// codeBlock is one fenced code block.
type codeBlock struct {
	info  string
	line  int // of the first line inside the fence
	lines []string
}

var shellInfo = map[string]bool{"sh": true, "bash": true, "shell": true, "console": true}

// otherInfo are the info strings of blocks that hold no commands.
var otherInfo = map[string]bool{"go": true, "sql": true, "text": true, "json": true, "yaml": true}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func readDocs(t *testing.T) []docFile {
	t.Helper()
	root := repoRoot(t)
	paths := []string{"README.md"}
	more, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range more {
		rel, _ := filepath.Rel(root, p)
		paths = append(paths, filepath.ToSlash(rel))
	}
	var docs []docFile
	for _, p := range paths {
		b, err := os.ReadFile(filepath.Join(root, p))
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, docFile{path: p, text: string(b)})
	}
	if len(docs) < 2 {
		t.Fatalf("found only %v: the docs moved?", paths)
	}
	return docs
}

var fenceRE = regexp.MustCompile("^(\\s*)(```+|~~~+)\\s*([^`\\s]*)")

// splitMarkdown returns f's fenced code blocks and its prose (every line
// outside a fence, the fences blanked so line numbers stay).
func splitMarkdown(text string) (blocks []codeBlock, prose []string) {
	lines := strings.Split(text, "\n")
	var cur *codeBlock
	var fence string
	for i, l := range lines {
		if cur == nil {
			if m := fenceRE.FindStringSubmatch(l); m != nil {
				cur = &codeBlock{info: m[3], line: i + 2}
				fence = m[2]
				prose = append(prose, "")
				continue
			}
			prose = append(prose, l)
			continue
		}
		if t := strings.TrimSpace(l); strings.HasPrefix(t, fence) && strings.Trim(t, fence[:1]) == "" {
			blocks = append(blocks, *cur)
			cur = nil
			prose = append(prose, "")
			continue
		}
		cur.lines = append(cur.lines, l)
		prose = append(prose, "")
	}
	if cur != nil {
		blocks = append(blocks, *cur)
	}
	return blocks, prose
}

// shellCommands returns the commands of a shell block: every line (for
// console, every line that starts with "$ "), continuations joined,
// comments dropped.
func shellCommands(path string, b codeBlock) []docCommand {
	var cmds []docCommand
	var pending strings.Builder
	start := 0
	for i, l := range b.lines {
		l = strings.TrimSpace(l)
		if pending.Len() == 0 {
			if b.info == "console" {
				if !strings.HasPrefix(l, "$ ") {
					continue // output
				}
				l = strings.TrimPrefix(l, "$ ")
			}
			start = b.line + i
		}
		l = stripComment(l)
		if strings.HasSuffix(l, "\\") {
			pending.WriteString(strings.TrimSpace(strings.TrimSuffix(l, "\\")) + " ")
			continue
		}
		pending.WriteString(l)
		if c := strings.TrimSpace(pending.String()); c != "" {
			cmds = append(cmds, docCommand{where: fmt.Sprintf("%s:%d", path, start), text: c})
		}
		pending.Reset()
	}
	if c := strings.TrimSpace(pending.String()); c != "" {
		cmds = append(cmds, docCommand{where: fmt.Sprintf("%s:%d", path, start), text: c})
	}
	return cmds
}

// stripComment drops a shell comment: a # at the start of a word, outside
// quotes.
func stripComment(l string) string {
	var quote rune
	for i, r := range l {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			}
		case r == '\'' || r == '"':
			quote = r
		case r == '#' && (i == 0 || l[i-1] == ' ' || l[i-1] == '\t'):
			return strings.TrimSpace(l[:i])
		}
	}
	return l
}

var inlineCodeRE = regexp.MustCompile("`([^`]+)`")

// inlineCommands returns the `gcloud ...` and `make ...` spans of the
// prose (a span may wrap over lines).
func inlineCommands(path string, prose []string) []docCommand {
	var cmds []docCommand
	joined := strings.Join(prose, "\n")
	for _, m := range inlineCodeRE.FindAllStringSubmatchIndex(joined, -1) {
		span := strings.Join(strings.Fields(joined[m[2]:m[3]]), " ")
		if strings.HasPrefix(span, "gcloud ") || strings.HasPrefix(span, "make ") {
			line := strings.Count(joined[:m[0]], "\n") + 1
			cmds = append(cmds, docCommand{where: fmt.Sprintf("%s:%d", path, line), text: span, inline: true})
		}
	}
	return cmds
}

// shellWords splits a command into words, honouring single and double
// quotes (which it removes). It refuses what it cannot judge: pipes, lists,
// redirections and command substitutions.
func shellWords(s string) ([]string, error) {
	var words []string
	var cur strings.Builder
	inWord := false
	var quote rune
	for _, r := range s {
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
				continue
			}
			cur.WriteRune(r)
		case r == '\'' || r == '"':
			quote, inWord = r, true
		case r == ' ' || r == '\t':
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		case strings.ContainsRune("|&;<>`", r):
			return nil, fmt.Errorf("%q: pipes, lists, redirections and backquotes are not checked; write one plain command per line", s)
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("%q: unbalanced quote", s)
	}
	if inWord {
		words = append(words, cur.String())
	}
	for _, w := range words {
		if strings.Contains(w, "$(") {
			return nil, fmt.Errorf("%q: command substitution is not checked", s)
		}
	}
	return words, nil
}

var envAssignRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*=`)

// allCommands is every command of every doc, and the docs' code blocks.
func allCommands(t *testing.T, docs []docFile) []docCommand {
	t.Helper()
	var cmds []docCommand
	for _, d := range docs {
		blocks, prose := splitMarkdown(d.text)
		for _, b := range blocks {
			switch {
			case shellInfo[b.info]:
				cmds = append(cmds, shellCommands(d.path, b)...)
			case otherInfo[b.info]:
			case b.info == "":
				t.Errorf("%s:%d: a code block without an info string; label it (sh for commands, go, text, ...)", d.path, b.line-1)
			default:
				t.Errorf("%s:%d: code block with info string %q: use sh for commands, or one of %v", d.path, b.line-1, b.info, slices.Sorted(maps.Keys(otherInfo)))
			}
		}
		cmds = append(cmds, inlineCommands(d.path, prose)...)
	}
	return cmds
}

// TestDocsCommandsAreChecked runs or verifies every command the docs show.
func TestDocsCommandsAreChecked(t *testing.T) {
	docs := readDocs(t)
	cmds := allCommands(t, docs)
	if len(cmds) == 0 {
		t.Fatal("no commands found in the docs: the parser is broken")
	}
	c := newCommandChecker(t)
	seen := map[string]bool{}
	for _, cmd := range cmds {
		if seen[cmd.text] {
			continue
		}
		seen[cmd.text] = true
		t.Run(cmd.text, func(t *testing.T) {
			if err := c.check(t, cmd); err != nil {
				t.Errorf("%s: %s\n  %v", cmd.where, cmd.text, err)
			}
		})
	}
}

// commandChecker knows how to check each kind of command.
type commandChecker struct {
	root     string
	makefile *makefile

	gcloudOnce sync.Once
	gcloud     string // the SDK's gcloud, "" when absent
	gcloudEnv  []string
	helps      map[string]string
}

func newCommandChecker(t *testing.T) *commandChecker {
	root := repoRoot(t)
	mk, err := parseMakefile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	return &commandChecker{root: root, makefile: mk, helps: map[string]string{}}
}

func (c *commandChecker) check(t *testing.T, cmd docCommand) error {
	words, err := shellWords(cmd.text)
	if err != nil {
		return err
	}
	var env []string
	for len(words) > 0 && envAssignRE.MatchString(words[0]) {
		env = append(env, words[0])
		words = words[1:]
	}
	if len(words) == 0 {
		return nil // only assignments: nothing runs
	}
	switch {
	case words[0] == "go" && len(words) > 1 && words[1] == "get" && !cmd.inline:
		return c.goGet(t, env, words[2:])
	case words[0] == "go" && len(words) > 1 && words[1] == "test" && !cmd.inline:
		return c.goTestSelects(env, words[2:])
	case words[0] == "go" && len(words) > 1 && (words[1] == "install" || words[1] == "build" || words[1] == "mod") && !cmd.inline:
		return c.releaseRuns(env, words[1:], cmd.where)
	case words[0] == "make":
		return c.makeCommand(t, env, words[1:])
	case words[0] == "gcloud":
		return c.gcloudCommand(t, words[1:])
	}
	return fmt.Errorf("no check knows this command: teach e2e/docs_test.go how to run or verify it, or leave it out of the docs")
}

// releaseRuns accepts `go install`, `go mod tidy` and `go build` in the
// README's Install and Quickstart sections, which internal/release's
// TestReleaseIsUsableFromAModuleProxy runs as written in a user's module,
// from a release served by a module proxy on disk (make test runs it): it
// checks that the command is in one of those sections and that the test
// still reads them; a `go install` must name a command of this repository
// at a version.
func (c *commandChecker) releaseRuns(env, args []string, where string) error {
	file, line, _ := strings.Cut(where, ":")
	n, err := strconv.Atoi(line)
	if file != "README.md" || err != nil || len(env) > 0 {
		return fmt.Errorf("go %s: checked only in README.md's Install and Quickstart sections, with no environment", strings.Join(args, " "))
	}
	readme, err := os.ReadFile(filepath.Join(c.root, "README.md"))
	if err != nil {
		return err
	}
	section := ""
	for i, l := range strings.Split(string(readme), "\n") {
		if i+1 >= n {
			break
		}
		if strings.HasPrefix(l, "## ") {
			section = l
		}
	}
	if section != "## Install" && section != "## Quickstart" {
		return fmt.Errorf("go %s under %q: only the Install and Quickstart sections are run by TestReleaseIsUsableFromAModuleProxy", strings.Join(args, " "), section)
	}
	test, err := os.ReadFile(filepath.Join(c.root, "internal", "release", "release_test.go"))
	if err != nil {
		return err
	}
	for _, want := range []string{"func TestReleaseIsUsableFromAModuleProxy(", `readmeGoCommands(t, readme, "` + section + `")`} {
		if !strings.Contains(string(test), want) {
			return fmt.Errorf("internal/release/release_test.go no longer has %s: nothing runs this command", want)
		}
	}
	switch {
	case args[0] == "mod" && len(args) == 2 && args[1] == "tidy", args[0] == "build" && len(args) == 2 && args[1] == "./...":
		return nil
	case args[0] == "install" && len(args) == 2:
		pkg, version, ok := strings.Cut(args[1], "@")
		rel, inRepo := strings.CutPrefix(pkg, "github.com/gcp-pubsub-idempotency/idempotency/")
		if !ok || version == "" || !inRepo {
			return fmt.Errorf("go install %s: want a command of this repository at a version", args[1])
		}
		src, err := os.ReadFile(filepath.Join(c.root, filepath.FromSlash(rel), "main.go"))
		if err != nil || !strings.Contains(string(src), "\npackage main\n") {
			return fmt.Errorf("go install %s: %s is not a command of this repository", args[1], rel)
		}
		return nil
	}
	return fmt.Errorf("go %s: not a command TestReleaseIsUsableFromAModuleProxy is known to run as written", strings.Join(args, " "))
}

// goGet runs `go get args...` in a scratch module whose go.mod replaces
// every module of this checkout (as a published version would resolve),
// then builds a program importing each package it got.
func (c *commandChecker) goGet(t *testing.T, env, args []string) error {
	var pkgs []string
	for _, a := range args {
		if strings.HasPrefix(a, "-") {
			return fmt.Errorf("go get flag %s: not checked", a)
		}
		pkgs = append(pkgs, strings.SplitN(a, "@", 2)[0])
	}
	if len(pkgs) == 0 {
		return fmt.Errorf("go get without a package")
	}
	dir := t.TempDir()
	gomod := "module example.com/docscheck\n\ngo 1.26\n" + localReplaces(c.root)
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(gomod), 0o644); err != nil {
		return err
	}
	goEnv := append(append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod"), env...)
	run := func(extraEnv []string, args ...string) (string, error) {
		cmd := exec.Command("go", args...)
		cmd.Dir, cmd.Env = dir, append(slices.Clone(goEnv), extraEnv...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return "", fmt.Errorf("go %s %s in a scratch module: %v\n%s", strings.Join(extraEnv, " "), strings.Join(args, " "), err, out)
		}
		return string(out), nil
	}
	// Our modules are not on a module proxy yet, and a proxy refuses the
	// query for their latest version (403) where the go command needs a
	// "not found" to fall back on the replace directive. So the command
	// runs as written with GOPROXY=off, every other module coming from the
	// module cache that building this workspace filled; should that lack
	// one, it runs again with each module pinned at the zero pseudo-version
	// the replace directive stands for, through the usual proxy.
	if _, err := run([]string{"GOPROXY=off"}, append([]string{"get"}, args...)...); err != nil {
		pinned := []string{"get"}
		for _, p := range pkgs {
			pinned = append(pinned, p+"@v0.0.0-00010101000000-000000000000")
		}
		if _, err2 := run(nil, pinned...); err2 != nil {
			return fmt.Errorf("%v\nand pinned to this checkout: %v", err, err2)
		}
	}
	var main strings.Builder
	main.WriteString("package main\n\nimport (\n")
	for _, p := range pkgs {
		fmt.Fprintf(&main, "\t_ %q\n", p)
	}
	main.WriteString(")\n\nfunc main() {}\n")
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(main.String()), 0o644); err != nil {
		return err
	}
	if _, err := run(nil, "build", "-o", os.DevNull, "."); err != nil {
		return err
	}
	mod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		return err
	}
	for _, p := range pkgs {
		if !strings.Contains(string(mod), p+" v") {
			return fmt.Errorf("after go get, go.mod does not require %s:\n%s", p, mod)
		}
	}
	return nil
}

// goTestFlagsWithValue are the go test flags that take a value.
var goTestFlagsWithValue = map[string]bool{
	"run": true, "bench": true, "benchtime": true, "count": true, "timeout": true, "parallel": true,
	"cpu": true, "tags": true, "fuzz": true, "fuzztime": true, "skip": true, "list": true,
	"coverprofile": true, "vet": true,
}

// goTestFlagsBool are the go test flags without a value.
var goTestFlagsBool = map[string]bool{"v": true, "race": true, "short": true, "cover": true, "failfast": true, "json": true}

// goTestSelects checks a go test command from the repository root: its
// flags are go test's, its package patterns resolve, and its -run (or
// -bench, or -fuzz) pattern selects at least one function in them. CI
// (make test) runs every test of every module; this proves the command
// as written does something.
func (c *commandChecker) goTestSelects(env, args []string) error {
	flags := map[string]string{}
	var pkgs []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "-args" {
			break
		}
		if !strings.HasPrefix(a, "-") {
			pkgs = append(pkgs, a)
			continue
		}
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		switch {
		case goTestFlagsBool[name]:
		case goTestFlagsWithValue[name]:
			if !hasVal {
				if i+1 >= len(args) {
					return fmt.Errorf("flag -%s without a value", name)
				}
				i++
				val = args[i]
			}
			flags[name] = val
		default:
			return fmt.Errorf("go test flag %s: not known to this check", a)
		}
	}
	if len(pkgs) == 0 {
		pkgs = []string{"."}
	}
	var pattern string
	switch {
	case flags["fuzz"] != "":
		pattern = flags["fuzz"]
	case flags["bench"] != "":
		pattern = flags["bench"]
	case flags["run"] != "":
		pattern = flags["run"]
	default:
		pattern = "."
	}
	// Only the top level of a pattern names a function (TestX/subtest).
	top := strings.SplitN(pattern, "/", 2)[0]
	re, err := regexp.Compile(top)
	if err != nil {
		return fmt.Errorf("pattern %q: %v", pattern, err)
	}
	golist := exec.Command("go", append([]string{"list", "-f", "{{.Dir}}|{{join .TestGoFiles \",\"}}|{{join .XTestGoFiles \",\"}}"}, pkgs...)...)
	golist.Dir, golist.Env = c.root, append(os.Environ(), env...)
	out, err := golist.Output()
	if err != nil {
		return fmt.Errorf("go list %v from the repository root: %v", pkgs, err)
	}
	var selected []string
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		parts := strings.Split(l, "|")
		if len(parts) != 3 {
			continue
		}
		for _, f := range strings.Split(parts[1]+","+parts[2], ",") {
			if f == "" {
				continue
			}
			for _, fn := range testFuncs(filepath.Join(parts[0], f)) {
				if re.MatchString(fn) {
					selected = append(selected, fn)
				}
			}
		}
	}
	if len(selected) == 0 {
		return fmt.Errorf("pattern %q selects no test, benchmark or fuzz target in %v", pattern, pkgs)
	}
	return nil
}

var testFuncRE = regexp.MustCompile(`(?m)^func ((?:Test|Benchmark|Fuzz|Example)[A-Za-z0-9_]*)\(`)

func testFuncs(file string) []string {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil
	}
	var names []string
	for _, m := range testFuncRE.FindAllStringSubmatch(string(b), -1) {
		if m[1] != "TestMain" {
			names = append(names, m[1])
		}
	}
	return names
}

// makefile is what the checks need of the Makefile.
type makefile struct {
	vars    map[string]string
	prereqs map[string][]string
	recipes map[string][]string
}

var (
	makeVarRE    = regexp.MustCompile(`^([A-Za-z_][A-Za-z0-9_]*)\s*(?::=|\?=|=)\s*(.*)$`)
	makeTargetRE = regexp.MustCompile(`^([A-Za-z0-9_.-]+)\s*:([^=].*)?$`)
)

func parseMakefile(path string) (*makefile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	mk := &makefile{vars: map[string]string{}, prereqs: map[string][]string{}, recipes: map[string][]string{}}
	var target string
	var cont strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasSuffix(l, "\\") {
			cont.WriteString(strings.TrimSuffix(l, "\\") + " ")
			continue
		}
		l = cont.String() + l
		cont.Reset()
		switch {
		case strings.HasPrefix(l, "\t"):
			if target != "" {
				mk.recipes[target] = append(mk.recipes[target], strings.TrimSpace(l))
			}
		case strings.HasPrefix(strings.TrimSpace(l), "#") || strings.TrimSpace(l) == "":
		case makeVarRE.MatchString(l):
			m := makeVarRE.FindStringSubmatch(l)
			mk.vars[m[1]] = strings.TrimSpace(m[2])
			target = ""
		case makeTargetRE.MatchString(l):
			m := makeTargetRE.FindStringSubmatch(l)
			target = m[1]
			if strings.HasPrefix(target, ".") {
				target = "" // .PHONY and friends
				continue
			}
			mk.prereqs[target] = strings.Fields(m[2])
			if _, ok := mk.recipes[target]; !ok {
				mk.recipes[target] = nil
			}
		}
	}
	return mk, sc.Err()
}

var makeRefRE = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expand replaces $(VAR) by its value (recursively) and $$ by $.
func (mk *makefile) expand(s string) string {
	for range 10 {
		next := makeRefRE.ReplaceAllStringFunc(s, func(ref string) string {
			return mk.vars[makeRefRE.FindStringSubmatch(ref)[1]]
		})
		if next == s {
			break
		}
		s = next
	}
	return strings.ReplaceAll(s, "$$", "$")
}

// makeCommand checks `make target...`.
func (c *commandChecker) makeCommand(t *testing.T, env, targets []string) error {
	if len(env) > 0 {
		return fmt.Errorf("make with variables %v: not checked", env)
	}
	if len(targets) == 0 {
		return fmt.Errorf("make without a target")
	}
	for _, target := range targets {
		if strings.HasPrefix(target, "-") || strings.Contains(target, "=") {
			return fmt.Errorf("make argument %q: not checked", target)
		}
		if _, ok := c.makefile.recipes[target]; !ok {
			return fmt.Errorf("the Makefile has no target %q", target)
		}
		if err := c.makeTarget(t, target); err != nil {
			return fmt.Errorf("make %s: %w", target, err)
		}
	}
	return nil
}

var (
	demoOnce                  sync.Once
	demoErr, functionErr      error
	functionOnce              sync.Once
	demoTimeout, buildTimeout = 5 * time.Minute, 10 * time.Minute
)

func (c *commandChecker) makeTarget(t *testing.T, target string) error {
	switch target {
	case "test":
		// CI's command: .ci/run must end in it.
		ci, err := os.ReadFile(filepath.Join(c.root, ".ci", "run"))
		if err != nil {
			return fmt.Errorf("CI runs make test, but .ci/run is unreadable: %v", err)
		}
		if !regexp.MustCompile(`(?m)^make test$`).Match(ci) {
			return fmt.Errorf(".ci/run does not run `make test`")
		}
		return nil
	case "demo":
		demoOnce.Do(func() {
			out, err := c.runMake(demoTimeout, "demo")
			switch {
			case err != nil:
				demoErr = err
			case !strings.Contains(out, "received order PO-1001 1 time(s) from 3 deliveries") ||
				!strings.Contains(out, "the duplicates were suppressed"):
				demoErr = fmt.Errorf("the demo did not report one order from three deliveries, duplicates suppressed:\n%s", out)
			}
		})
		return demoErr
	case "function-source":
		functionOnce.Do(func() {
			if _, err := c.runMake(buildTimeout, "function-source"); err != nil {
				functionErr = err
				return
			}
			for _, f := range []string{"go.mod", "function.go", "vendor/modules.txt",
				"vendor/github.com/gcp-pubsub-idempotency/idempotency/idempotent.go"} {
				if _, err := os.Stat(filepath.Join(c.root, "build", "function", f)); err != nil {
					functionErr = fmt.Errorf("build/function lacks %s", f)
					return
				}
			}
		})
		return functionErr
	}
	if slices.Contains(c.makefile.prereqs["test"], target) {
		return nil // make test runs it first
	}
	recipe := c.makefile.recipes[target]
	if len(recipe) == 0 {
		return fmt.Errorf("no recipe, and not a prerequisite of test")
	}
	testRecipe := c.makefile.expand(strings.Join(c.makefile.recipes["test"], "\n"))
	for _, line := range recipe {
		line = c.makefile.expand(line)
		words, err := shellWords(line)
		if err != nil {
			return err
		}
		var env []string
		for len(words) > 0 && envAssignRE.MatchString(words[0]) {
			env = append(env, words[0])
			words = words[1:]
		}
		switch {
		case len(words) >= 2 && words[0] == "go" && words[1] == "test":
			if err := c.goTestSelects(env, words[2:]); err != nil {
				return fmt.Errorf("recipe %q: %w", line, err)
			}
		case len(words) >= 3 && words[0] == "go" && words[1] == "run" && strings.HasPrefix(words[2], "./internal/"):
			if err := c.goRunFlags(t, words[2], words[3:]); err != nil {
				return fmt.Errorf("recipe %q: %w", line, err)
			}
		case len(words) >= 1 && strings.HasPrefix(words[0], "./scripts/"):
			if !strings.Contains(testRecipe, words[0]) {
				return fmt.Errorf("recipe runs %s, which make test does not run", words[0])
			}
		default:
			return fmt.Errorf("recipe line %q: no check knows it", line)
		}
	}
	return nil
}

// goRunFlags checks `go run ./internal/<cmd> args...` in a recipe: the
// command builds (make test runs its tests with every package's), and
// every -flag the recipe passes is one its usage (-h) lists.
func (c *commandChecker) goRunFlags(t *testing.T, pkg string, args []string) error {
	bin := filepath.Join(t.TempDir(), "cmd")
	build := exec.Command("go", "build", "-o", bin, pkg)
	build.Dir = c.root
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %v\n%s", pkg, err, out)
	}
	usage, _ := exec.Command(bin, "-h").CombinedOutput() // -h exits 2 after the usage
	for _, a := range args {
		name, ok := strings.CutPrefix(a, "-")
		if !ok {
			continue
		}
		name, _, _ = strings.Cut(strings.TrimPrefix(name, "-"), "=")
		if !regexp.MustCompile(`(?m)^\s+-` + regexp.QuoteMeta(name) + `\b`).Match(usage) {
			return fmt.Errorf("%s has no flag -%s:\n%s", pkg, name, usage)
		}
	}
	return nil
}

// runMake runs make target in the repository, bounded by timeout.
func (c *commandChecker) runMake(timeout time.Duration, target string) (string, error) {
	cmd := exec.Command("make", target)
	cmd.Dir = c.root
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return "", err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return out.String(), fmt.Errorf("%v\n%s", err, out.String())
		}
		return out.String(), nil
	case <-time.After(timeout):
		_ = cmd.Process.Kill()
		<-done
		return out.String(), fmt.Errorf("did not finish within %v:\n%s", timeout, out.String())
	}
}

var ansiRE = regexp.MustCompile("\x1b\\[[0-9;]*m")

// gcloudCommand checks a gcloud command offline against the local SDK:
// the words before the first flag name a command (not a group) that the
// SDK knows, and every --flag appears in that command's --help.
func (c *commandChecker) gcloudCommand(t *testing.T, args []string) error {
	c.gcloudOnce.Do(func() {
		if _, err := exec.LookPath("gcloud"); err != nil {
			return
		}
		out, err := exec.Command("gcloud", "info", "--format=value(installation.sdk_root)").Output()
		if err != nil {
			return
		}
		bin := filepath.Join(strings.TrimSpace(string(out)), "bin", "gcloud")
		if _, err := os.Stat(bin); err != nil {
			return
		}
		c.gcloud = bin
		cfg, err := os.MkdirTemp("", "docs-gcloud-")
		if err != nil {
			c.gcloud = ""
			return
		}
		c.gcloudEnv = append(os.Environ(), "CLOUDSDK_CONFIG="+cfg, "CLOUDSDK_CORE_DISABLE_PROMPTS=1",
			"CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK=1", "PAGER=cat")
	})
	if c.gcloud == "" {
		if os.Getenv("IDEMPOTENCY_REQUIRE_SERVICES") != "" {
			return fmt.Errorf("gcloud is not installed and IDEMPOTENCY_REQUIRE_SERVICES is set: the Google Cloud SDK is needed to check the docs' gcloud commands")
		}
		t.Skip("gcloud is not installed (install the Google Cloud SDK to check the docs' gcloud commands)")
	}
	var path, flags []string
	for _, a := range args {
		if strings.HasPrefix(a, "-") {
			flags = append(flags, a)
		} else if len(flags) == 0 {
			path = append(path, a)
		}
	}
	key := strings.Join(path, " ")
	help, ok := c.helps[key]
	if !ok {
		cmd := exec.Command(c.gcloud, append(slices.Clone(path), "--help")...)
		cmd.Env = c.gcloudEnv
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("gcloud %s --help: %v\n%s", key, err, out)
		}
		help = ansiRE.ReplaceAllString(string(out), "")
		c.helps[key] = help
	}
	// The NAME section says which command the words named; positional
	// arguments follow it.
	name := regexp.MustCompile(`(?m)^NAME\n\s+(gcloud[a-z0-9 -]*?) - `).FindStringSubmatch(help)
	if name == nil {
		return fmt.Errorf("gcloud %s --help has no NAME section:\n%s", key, help)
	}
	command := strings.Fields(name[1])[1:]
	if len(command) == 0 || len(command) > len(path) || !slices.Equal(command, path[:len(command)]) {
		return fmt.Errorf("gcloud %s names the command %q", key, name[1])
	}
	if regexp.MustCompile(`(?m)^(GROUPS|COMMANDS)$`).MatchString(help) {
		return fmt.Errorf("%q is a command group, not a command", name[1])
	}
	for _, f := range flags {
		flag, _, _ := strings.Cut(f, "=")
		if !strings.HasPrefix(flag, "--") {
			return fmt.Errorf("flag %s: only --long flags are checked", f)
		}
		bare := strings.TrimPrefix(flag, "--")
		candidates := []string{flag, "--[no-]" + bare}
		if rest, ok := strings.CutPrefix(bare, "no-"); ok {
			candidates = append(candidates, "--[no-]"+rest)
		}
		found := false
		for _, cand := range candidates {
			if regexp.MustCompile(regexp.QuoteMeta(cand) + `([^a-z0-9-]|$)`).MatchString(help) {
				found = true
				break
			}
		}
		if !found {
			return fmt.Errorf("%s has no flag %s in its --help", name[1], flag)
		}
	}
	given := givenPositionals(help, args[len(command):])
	if need := requiredPositionals(help); len(given) < len(need) {
		return fmt.Errorf("%s needs the positional arguments %s (without a prompt), and is given %d: %q", name[1], strings.Join(need, " "), len(given), given)
	}
	return nil
}

// givenPositionals are the words of args (a gcloud command's words after
// the command's name) that are positional arguments: not flags, and not
// the value of a flag that takes one (--flag=VALUE in its --help) written
// as the next word.
func givenPositionals(help string, args []string) []string {
	var pos []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			pos = append(pos, a)
			continue
		}
		if strings.Contains(a, "=") || i+1 == len(args) {
			continue
		}
		if regexp.MustCompile(`(^|[^a-z0-9-])` + regexp.QuoteMeta(a) + `=`).MatchString(help) {
			i++ // the flag's value
		}
	}
	return pos
}

var (
	synopsisRE  = regexp.MustCompile(`(?ms)^SYNOPSIS\n(.*?)\n(?:[A-Z][A-Z ]*\n|\z)`)
	positionsRE = regexp.MustCompile(`(?ms)^POSITIONAL ARGUMENTS\n(.*?)\n(?:[A-Z][A-Z ]*\n|\z)`)
	upperWordRE = regexp.MustCompile(`[A-Z][A-Z0-9_-]*`)
)

// requiredPositionals are the positional arguments a gcloud command needs
// when it may not prompt (the docs' commands run in scripts): those its
// --help SYNOPSIS shows outside [brackets], and the bracketed ones whose
// POSITIONAL ARGUMENTS entry offers no way to set them but the command
// line and an interactive prompt (gcloud run deploy's [SERVICE]: without
// it, and without a prompt, the command fails with "Error parsing
// [service]").
func requiredPositionals(help string) []string {
	m := synopsisRE.FindStringSubmatch(help)
	if m == nil {
		return nil
	}
	synopsis := strings.Join(strings.Fields(m[1]), " ")
	var need []string
	depth := 0
	for i := 0; i < len(synopsis); i++ {
		switch c := synopsis[i]; {
		case c == '[':
			depth++
		case c == ']':
			depth--
		case c >= 'A' && c <= 'Z' && (i == 0 || !inPlaceholder(synopsis[i-1])):
			w := upperWordRE.FindString(synopsis[i:])
			i += len(w) - 1
			if i+1 < len(synopsis) && inPlaceholder(synopsis[i+1]) {
				continue // a flag's VALUE, KEY=VALUE, or not a placeholder
			}
			if w == "GCLOUD_WIDE_FLAG" || slices.Contains(need, w) {
				continue
			}
			if depth == 0 || promptOnly(help, w) {
				need = append(need, w)
			}
		}
	}
	return need
}

// inPlaceholder reports whether c, next to an upper-case word of a
// SYNOPSIS, makes it part of a flag's value or of a word that is not a
// positional's name.
func inPlaceholder(c byte) bool {
	return c == '=' || c == ',' || c == '_' || c == '-' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// promptOnly reports whether the POSITIONAL ARGUMENTS entry of the
// bracketed positional name lists only the command line and an
// interactive prompt as ways to set it.
func promptOnly(help, name string) bool {
	m := positionsRE.FindStringSubmatch(help)
	if m == nil {
		return false
	}
	entry := regexp.MustCompile(`(?m)^ +\[` + regexp.QuoteMeta(name) + `\]\n((?: *\n| {8,}.*\n)*)`).FindStringSubmatch(m[1] + "\n")
	if entry == nil {
		return false
	}
	ways := regexp.MustCompile(`(?m)^ +[▸◆•*-] (.*(?:\n {12,}[^▸◆•* ].*)*)`).FindAllStringSubmatch(entry[1], -1)
	prompt := false
	for _, w := range ways {
		way := strings.Join(strings.Fields(w[1]), " ")
		switch {
		case strings.Contains(way, "interactive prompt"):
			prompt = true
		case strings.HasPrefix(way, "provide the argument "+name+" on the command line"):
		default:
			return false
		}
	}
	return prompt
}

// TestDocsREADMEIsShort keeps the README a five-minute read.
func TestDocsREADMEIsShort(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if len(b) > maxReadme {
		t.Errorf("README.md is %d bytes, over the %d-byte budget: move detail to docs/", len(b), maxReadme)
	}
}

var (
	linkRE    = regexp.MustCompile(`\[[^\]]*\]\(([^)\s]+)\)`)
	headingRE = regexp.MustCompile(`(?m)^#{1,6}\s+(.+?)\s*#*\s*$`)
)

// anchors returns the GitHub anchors of a markdown file's headings.
func anchors(text string) map[string]bool {
	_, prose := splitMarkdown(text)
	got := map[string]bool{}
	count := map[string]int{}
	for _, m := range headingRE.FindAllStringSubmatch(strings.Join(prose, "\n"), -1) {
		h := strings.ToLower(m[1])
		h = strings.NewReplacer("`", "", "*", "").Replace(h)
		var b strings.Builder
		for _, r := range h {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r > 127:
				b.WriteRune(r)
			}
		}
		slug := b.String()
		if n := count[slug]; n > 0 {
			got[fmt.Sprintf("%s-%d", slug, n)] = true
		} else {
			got[slug] = true
		}
		count[slug]++
	}
	return got
}

// TestDocsRelativeLinksResolve: every relative link in the README and
// docs/ points at a file that exists and, with a #fragment, at a heading
// of that file.
func TestDocsRelativeLinksResolve(t *testing.T) {
	root := repoRoot(t)
	docs := readDocs(t)
	for _, d := range docs {
		_, prose := splitMarkdown(d.text)
		text := inlineCodeRE.ReplaceAllString(strings.Join(prose, "\n"), "")
		for _, m := range linkRE.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if regexp.MustCompile(`^[a-z]+:`).MatchString(target) {
				continue // https:, mailto:
			}
			file, frag, _ := strings.Cut(target, "#")
			path := filepath.Join(root, filepath.Dir(d.path), file)
			if file == "" {
				path = filepath.Join(root, d.path)
			}
			info, err := os.Stat(path)
			if err != nil {
				t.Errorf("%s: link %q: %s does not exist", d.path, target, file)
				continue
			}
			if frag == "" {
				continue
			}
			if info.IsDir() || !strings.HasSuffix(path, ".md") {
				t.Errorf("%s: link %q: a fragment on something that is not a markdown file", d.path, target)
				continue
			}
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !anchors(string(b))[frag] {
				t.Errorf("%s: link %q: %s has no heading #%s", d.path, target, file, frag)
			}
		}
	}
}

var (
	docTestNameRE  = regexp.MustCompile(`^((?:Test|Benchmark|Fuzz)[A-Z0-9_][A-Za-z0-9_]*)(?:/.*)?$`)
	contractNameRE = regexp.MustCompile(`^[a-z0-9]+(?:_[a-z0-9]+){3,}$`)
)

// TestDocsNameTestsThatExist: a test, benchmark or fuzz target named in
// inline code in the docs exists in some package of the repository, and a
// conformance case named there (a snake_case name) is one the suite runs.
// Tests move between files; the docs name them by package, so a rename
// is what this catches.
func TestDocsNameTestsThatExist(t *testing.T) {
	root := repoRoot(t)
	funcs := map[string]bool{}
	var suite strings.Builder
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "build" || d.Name() == "vendor" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if strings.HasSuffix(p, "_test.go") {
			for _, fn := range testFuncs(p) {
				funcs[fn] = true
			}
		}
		if strings.HasSuffix(p, ".go") && strings.Contains(filepath.ToSlash(p), "/store/storetest/") && !strings.HasSuffix(p, "_test.go") {
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			suite.Write(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(funcs) < 50 || suite.Len() == 0 {
		t.Fatalf("found %d test functions and %d bytes of the suite: the layout moved?", len(funcs), suite.Len())
	}
	for _, d := range readDocs(t) {
		_, prose := splitMarkdown(d.text)
		for _, m := range inlineCodeRE.FindAllStringSubmatch(strings.Join(prose, "\n"), -1) {
			span := m[1]
			if n := docTestNameRE.FindStringSubmatch(span); n != nil {
				if !funcs[n[1]] {
					t.Errorf("%s names %s, which no _test.go file of the repository defines", d.path, n[1])
				}
				continue
			}
			if contractNameRE.MatchString(span) && !strings.Contains(suite.String(), `"`+span+`"`) {
				t.Errorf("%s names the conformance case %s, which store/storetest does not define", d.path, span)
			}
		}
	}
}

// TestDocsCheckerRefusesWhatItCannotVouchFor shows that the checks above
// can fail: each command here is wrong, or of a kind no check knows, and
// must be refused.
func TestDocsCheckerRefusesWhatItCannotVouchFor(t *testing.T) {
	c := newCommandChecker(t)
	bad := []string{
		"curl https://example.com",
		"go build ./...",
		"go vet ./...",
		"ls | wc -l",
		"make demo && make test",
		"echo $(date)",
		"make no-such-target",
		"make STORM_ORDERS=5 storm",
		"go get -u github.com/gcp-pubsub-idempotency/idempotency",
		"go get github.com/gcp-pubsub-idempotency/idempotency/store/nosuchlock",
		"go test -run TestNoSuchTestAnywhere github.com/gcp-pubsub-idempotency/idempotency/fake",
		"go test -frobnicate github.com/gcp-pubsub-idempotency/idempotency/fake",
		"go test github.com/gcp-pubsub-idempotency/idempotency/no/such/package",
	}
	if _, err := exec.LookPath("gcloud"); err == nil {
		bad = append(bad,
			"gcloud functions deploy handle-order --gen2 --no-such-flag",
			"gcloud pubsub subscriptions --help-me",
			"gcloud pubsub subscriptions",
			"gcloud pubsub subscripshuns update SUB",
			"gcloud pubsub subscriptions update --dead-letter-topic=orders-dead-letter",
			"gcloud run deploy --source=build/function --function=HandleOrder",
			"gcloud run services add-iam-policy-binding --region us-central1 --member=user:a@example.com --role=roles/run.invoker",
		)
	}
	for _, text := range bad {
		t.Run(text, func(t *testing.T) {
			if err := c.check(t, docCommand{where: "self-test", text: text}); err == nil {
				t.Errorf("%q was accepted", text)
			}
		})
	}
}

// TestDocsMarkdownParsing pins how commands, continuations, console
// prompts and headings are read.
func TestDocsMarkdownParsing(t *testing.T) {
	md := "# Top: a `title`\n\n```sh\nmake demo   # a comment\ngcloud a b \\\n    --c=d\n\n```\n\n" +
		"```console\n$ make test\nok output line\n```\n\nSee `make bench` and `go test` in prose.\n\n## Top: a title\n"
	blocks, prose := splitMarkdown(md)
	if len(blocks) != 2 || blocks[0].info != "sh" || blocks[1].info != "console" {
		t.Fatalf("blocks: %+v", blocks)
	}
	var got []string
	for _, b := range blocks {
		for _, c := range shellCommands("x.md", b) {
			got = append(got, c.where+" "+c.text)
		}
	}
	for _, c := range inlineCommands("x.md", prose) {
		got = append(got, c.where+" "+c.text)
	}
	want := []string{"x.md:4 make demo", "x.md:5 gcloud a b --c=d", "x.md:11 make test", "x.md:15 make bench"}
	if !slices.Equal(got, want) {
		t.Errorf("commands:\n got %q\nwant %q", got, want)
	}
	a := anchors(md)
	if !a["top-a-title"] || !a["top-a-title-1"] || len(a) != 2 {
		t.Errorf("anchors: %v", a)
	}
}
