package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/mod/module"
	modzip "golang.org/x/mod/zip"
)

// testVersion is the version the tests release: one no go.mod holds, so
// that the rewrite of every requirement is exercised.
const testVersion = "v0.99.0"

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// gitEnv gives git an identity of its own, whatever the machine's config.
var gitEnv = []string{
	"GIT_AUTHOR_NAME=release test", "GIT_AUTHOR_EMAIL=release@example.com",
	"GIT_COMMITTER_NAME=release test", "GIT_COMMITTER_EMAIL=release@example.com",
	"GIT_CONFIG_GLOBAL=/dev/null", "GIT_CONFIG_NOSYSTEM=1",
}

func gitT(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir, cmd.Env = dir, append(os.Environ(), gitEnv...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// copyCheckout copies this checkout (tracked files and untracked ones git
// does not ignore: what the next commit would hold) into a new git
// repository with one commit, and returns its directory.
func copyCheckout(t *testing.T) string {
	t.Helper()
	src := repoRoot(t)
	dst := t.TempDir()
	cmd := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard")
	cmd.Dir = src
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	for rel := range strings.SplitSeq(strings.TrimRight(string(out), "\x00"), "\x00") {
		from := filepath.Join(src, rel)
		info, err := os.Lstat(from)
		if err != nil || !info.Mode().IsRegular() {
			continue // deleted in the working tree, or not a plain file
		}
		data, err := os.ReadFile(from)
		if err != nil {
			t.Fatal(err)
		}
		to := filepath.Join(dst, rel)
		if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(to, data, info.Mode().Perm()); err != nil {
			t.Fatal(err)
		}
	}
	gitT(t, dst, "init", "-q", "-b", "main")
	gitT(t, dst, "add", "-A")
	gitT(t, dst, "commit", "-q", "-m", "the checkout under test")
	return dst
}

func runRelease(t *testing.T, args ...string) (string, error) {
	t.Helper()
	for _, kv := range gitEnv {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	var out bytes.Buffer
	err := run(args, &out, &out)
	return out.String(), err
}

// The checked-in module set: every requirement of one of our modules on
// another is at one release version (not a pseudo-version), with a replace
// directive to the other's directory, and no released module requires an
// unreleased one. A module added without them fails here; `go run
// ./internal/release -sync VERSION` fixes it.
func TestModuleSetIsConsistent(t *testing.T) {
	mods, err := discover(repoRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	v, err := setVersion(mods)
	if err != nil {
		t.Fatalf("%v\nrun: go run ./internal/release -sync vX.Y.Z", err)
	}
	if v == "" {
		t.Fatal("no module requires another: discovery is broken?")
	}
	for _, p := range checkSet(mods, v) {
		t.Error(p)
	}
	levels, err := tagOrder(mods)
	if err != nil {
		t.Fatal(err)
	}
	if len(levels) < 2 || len(levels[0]) != 1 || levels[0][0].Dir != "." {
		t.Fatalf("tag order %v: want the root module alone first", levelDirs(levels))
	}
}

func levelDirs(levels [][]*Module) [][]string {
	var s [][]string
	for _, l := range levels {
		var d []string
		for _, m := range l {
			d = append(d, m.Dir)
		}
		s = append(s, d)
	}
	return s
}

func TestTagOrderPutsEachModuleAfterItsRequirements(t *testing.T) {
	mods, err := discover(repoRoot(t))
	if err != nil {
		t.Fatal(err)
	}
	levels, err := tagOrder(mods)
	if err != nil {
		t.Fatal(err)
	}
	at := map[*Module]int{}
	for i, l := range levels {
		for _, m := range l {
			at[m] = i
			if !m.Released() {
				t.Errorf("%s is under internal/ but is tagged", m.Dir)
			}
		}
	}
	for m, deps := range siblings(mods) {
		if !m.Released() {
			continue
		}
		for _, d := range deps {
			if at[d] >= at[m] {
				t.Errorf("%s (level %d) requires %s (level %d): it must be tagged after it", m.Dir, at[m], d.Dir, at[d])
			}
		}
	}
	for _, m := range mods {
		if _, ok := at[m]; !ok && m.Released() {
			t.Errorf("%s is not tagged", m.Dir)
		}
	}
}

func TestReleaseChangelog(t *testing.T) {
	in := "# Changelog\n\nintro\n\n## [Unreleased]\n\n### Added\n\n- a thing.\n"
	out, err := releaseChangelog([]byte(in), "v0.2.0", "2030-01-02")
	if err != nil {
		t.Fatal(err)
	}
	want := "# Changelog\n\nintro\n\n## [Unreleased]\n\n## [v0.2.0] - 2030-01-02\n\n### Added\n\n- a thing.\n"
	if string(out) != want {
		t.Fatalf("got\n%s\nwant\n%s", out, want)
	}
	if _, err := releaseChangelog(out, "v0.2.0", "2030-01-02"); err == nil {
		t.Error("released the same version twice")
	}
	if _, err := releaseChangelog(out, "v0.3.0", "2030-01-02"); err == nil {
		t.Error("released an empty Unreleased section")
	}
	if _, err := releaseChangelog([]byte("# Changelog\n"), "v0.3.0", "2030-01-02"); err == nil {
		t.Error("released without an Unreleased heading")
	}
}

func TestReleaseRefusesBadVersions(t *testing.T) {
	dir := copyCheckout(t)
	for _, v := range []string{"0.1.0", "v0.1", "v2.0.0", "v0.1.0+build"} {
		if _, err := runRelease(t, "-n", "-C", dir, v); err == nil {
			t.Errorf("release %s: no error", v)
		}
	}
	gitT(t, dir, "tag", "v0.5.0")
	if out, err := runRelease(t, "-n", "-C", dir, "v0.4.0"); err == nil || !strings.Contains(err.Error(), "not above") {
		t.Errorf("release v0.4.0 after v0.5.0: %v\n%s", err, out)
	}
	if err := os.WriteFile(filepath.Join(dir, "README.md"), []byte("changed\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := runRelease(t, "-C", dir, "-base", "none", "v0.6.0"); err == nil || !strings.Contains(err.Error(), "uncommitted") {
		t.Errorf("release from a dirty tree: %v", err)
	}
}

func TestReleaseDryRunChangesNothing(t *testing.T) {
	dir := copyCheckout(t)
	head := gitT(t, dir, "rev-parse", "HEAD")
	out, err := runRelease(t, "-n", "-C", dir, "-date", "2030-01-02", testVersion)
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for _, want := range []string{
		"+\tgithub.com/gcp-pubsub-idempotency/idempotency " + testVersion,
		"+## [" + testVersion + "] - 2030-01-02",
		"would commit",
		"\n  " + testVersion + "\n",
		"git push origin " + testVersion + "\n",
		"Nothing was pushed",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("dry run output lacks %q:\n%s", want, out)
		}
	}
	if st := gitT(t, dir, "status", "--porcelain"); st != "" {
		t.Errorf("the dry run changed files:\n%s", st)
	}
	if tags := gitT(t, dir, "tag"); tags != "" {
		t.Errorf("the dry run tagged: %s", tags)
	}
	if h := gitT(t, dir, "rev-parse", "HEAD"); h != head {
		t.Error("the dry run committed")
	}
}

// The proof that a release is usable where users are: release a copy of
// this checkout, serve its tags from a module proxy on disk (the files a
// GOPROXY serves: list, .info, .mod, .zip), and in a scratch module with no
// replace directive and no go.work run the README's `go get` lines, build
// the README's quickstart, and write and build the deploy directory
// (scripts/function-source.sh at the release). Third-party modules come
// from this machine's module cache, read as a proxy, then from GOPROXY.
func TestReleaseIsUsableFromAModuleProxy(t *testing.T) {
	dir := copyCheckout(t)
	out, err := runRelease(t, "-C", dir, "-date", "2030-01-02", testVersion)
	if err != nil {
		t.Fatalf("release: %v\n%s", err, out)
	}

	// What the release did: the release commit, tagged, then the commit
	// that puts the replace directives back; nothing pushed.
	if msg := gitT(t, dir, "log", "-1", "--format=%s", "HEAD~1"); msg != "release: "+testVersion {
		t.Errorf("the commit before the last is %q", msg)
	}
	if msg := gitT(t, dir, "log", "-1", "--format=%s"); msg != devCommit(testVersion) {
		t.Errorf("last commit %q", msg)
	}
	if st := gitT(t, dir, "status", "--porcelain"); st != "" {
		t.Errorf("left uncommitted:\n%s", st)
	}
	if r := gitT(t, dir, "remote"); r != "" {
		t.Errorf("remotes %q", r)
	}
	mods, err := discover(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range checkSet(mods, testVersion) {
		t.Error(p)
	}
	cl, _ := os.ReadFile(filepath.Join(dir, "CHANGELOG.md"))
	if !bytes.Contains(cl, []byte("## [Unreleased]\n\n## ["+testVersion+"] - 2030-01-02\n")) {
		t.Error("CHANGELOG.md: no release heading under Unreleased")
	}
	tagged := strings.Fields(gitT(t, dir, "tag", "--points-at", "HEAD~1"))
	var released []*Module
	for _, m := range mods {
		if m.Released() {
			released = append(released, m)
			if !slices.Contains(tagged, m.Tag(testVersion)) {
				t.Errorf("no tag %s", m.Tag(testVersion))
			}
			// go install MODULE/cmd@VERSION refuses a go.mod with a
			// replace directive.
			if mod := gitT(t, dir, "show", m.Tag(testVersion)+":"+path.Join(m.Dir, "go.mod")); strings.Contains(mod, "replace") {
				t.Errorf("%s/go.mod at %s has a replace directive:\n%s", m.Dir, m.Tag(testVersion), mod)
			}
		}
	}
	if len(tagged) != len(released) {
		t.Errorf("tags %v, want one per released module (%d)", tagged, len(released))
	}
	pushes := regexp.MustCompile(`(?m)^  git push origin (.*)$`).FindAllStringSubmatch(out, -1)
	if len(pushes) < 3 || pushes[0][1] != "main" || pushes[1][1] != testVersion {
		t.Fatalf("push commands %q: want the branch, then the root module's tag alone", pushes)
	}
	if t.Failed() {
		t.FailNow()
	}

	proxy := t.TempDir()
	for _, m := range released {
		writeProxyVersion(t, proxy, dir, m, testVersion)
	}

	// The README's Install commands, exactly as written: the go get
	// lines, and go install of idemctl.
	c := newConsumer(t, proxy)
	readme := filepath.Join(dir, "README.md")
	install := readmeGoCommands(t, readme, "## Install")
	var gets [][]string
	installed := false
	for _, args := range install {
		c.goCmd(t, c.dir, args...)
		switch args[0] {
		case "get":
			gets = append(gets, args)
		case "install":
			installed = installed || strings.Contains(strings.Join(args, " "), "/cmd/idemctl@")
		}
	}
	if len(gets) == 0 || !installed {
		t.Fatalf("README.md's Install section has no `go get` line or no `go install .../cmd/idemctl@VERSION` line: %q", install)
	}
	for _, args := range gets {
		for _, a := range args[1:] {
			if strings.HasPrefix(a, "-") || strings.Contains(a, "@") {
				t.Fatalf("go get %v: a flag or a version; this test runs plain `go get PKG` lines", args[1:])
			}
		}
	}
	if out, err := exec.Command(filepath.Join(c.bin, "idemctl"), "help").CombinedOutput(); err != nil || !strings.Contains(string(out), "Usage:") {
		t.Errorf("the installed idemctl help: %v\n%s", err, out)
	}
	// The example's commands, installed from the proxy.
	for _, cmd := range []string{"local", "cloudrun"} {
		c.goCmd(t, c.dir, "install", "github.com/gcp-pubsub-idempotency/idempotency/function_example/cmd/"+cmd+"@"+testVersion)
		if _, err := os.Stat(filepath.Join(c.bin, cmd)); err != nil {
			t.Errorf("go install of function_example/cmd/%s: %v", cmd, err)
		}
	}
	gomod, _ := os.ReadFile(filepath.Join(c.dir, "go.mod"))
	for _, args := range gets {
		for _, p := range args[1:] {
			if !strings.Contains(string(gomod), p+" "+testVersion) {
				t.Errorf("after %q the consumer's go.mod does not require %s %s:\n%s", args, p, testVersion, gomod)
			}
		}
	}
	if strings.Contains(string(gomod), "replace") {
		t.Fatalf("the consumer's go.mod has a replace directive:\n%s", gomod)
	}

	// The quickstart, with the two functions it leaves to the reader.
	quick := readmeQuickstart(t, filepath.Join(dir, "README.md"))
	pkg := regexp.MustCompile(`(?m)^package (\w+)`).FindStringSubmatch(quick)
	if pkg == nil {
		t.Fatalf("the quickstart has no package clause:\n%s", quick)
	}
	if err := os.WriteFile(filepath.Join(c.dir, "quickstart.go"), []byte(quick), 0o644); err != nil {
		t.Fatal(err)
	}
	var imports strings.Builder
	for _, args := range gets {
		for _, p := range args[1:] {
			fmt.Fprintf(&imports, "\t_ %q\n", p)
		}
	}
	stub := fmt.Sprintf(`package %s

import (
	"context"

	"github.com/gcp-pubsub-idempotency/idempotency/fake"
	"github.com/gcp-pubsub-idempotency/idempotency/store"
%s)

func newBackend() store.Backend { return fake.New() }

func sendToSupplier(context.Context, []byte) error { return nil }
`, pkg[1], imports.String())
	if err := os.WriteFile(filepath.Join(c.dir, "reader.go"), []byte(stub), 0o644); err != nil {
		t.Fatal(err)
	}
	// Then the Quickstart's own commands, exactly as written.
	quickCmds := readmeGoCommands(t, readme, "## Quickstart")
	if !slices.ContainsFunc(quickCmds, func(a []string) bool { return a[0] == "build" }) {
		t.Fatalf("README.md's Quickstart has no `go build` command: %q", quickCmds)
	}
	for _, args := range quickCmds {
		c.goCmd(t, c.dir, args...)
	}

	// The deploy directory, at the release.
	fn := filepath.Join(t.TempDir(), "function")
	cmd := exec.Command(filepath.Join(dir, "scripts", "function-source.sh"), fn)
	cmd.Dir, cmd.Env = dir, append(slices.Clone(c.env), "IDEMPOTENCY_VERSION="+testVersion, "GOFLAGS=-modcacherw -trimpath")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("function-source.sh at %s: %v\n%s", testVersion, err, b)
	}
	fnmod, _ := os.ReadFile(filepath.Join(fn, "go.mod"))
	if strings.Contains(string(fnmod), "replace") || !strings.Contains(string(fnmod), "github.com/gcp-pubsub-idempotency/idempotency/function_example "+testVersion) {
		t.Fatalf("the deploy directory's go.mod:\n%s", fnmod)
	}
	build := exec.Command("go", "build", "-o", os.DevNull, "./...")
	build.Dir, build.Env = fn, append(slices.Clone(c.env), "GOPROXY=off", "GOFLAGS=-mod=vendor -trimpath")
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build in the deploy directory: %v\n%s", err, b)
	}
}

// writeProxyVersion adds module m at version v, as tagged in the git
// repository dir, to the module proxy on disk at proxy (the GOPROXY
// protocol's files: $module/@v/list, $version.info, .mod and .zip, with the
// module path case-escaped).
func writeProxyVersion(t *testing.T, proxy, dir string, m *Module, v string) {
	t.Helper()
	esc, err := module.EscapePath(m.Path)
	if err != nil {
		t.Fatal(err)
	}
	at := filepath.Join(proxy, filepath.FromSlash(esc), "@v")
	if err := os.MkdirAll(at, 0o755); err != nil {
		t.Fatal(err)
	}
	tag := m.Tag(v)
	subdir := ""
	if m.Dir != "." {
		subdir = m.Dir
	}
	var zip bytes.Buffer
	if err := modzip.CreateFromVCS(&zip, module.Version{Path: m.Path, Version: v}, dir, tag, subdir); err != nil {
		t.Fatalf("zip of %s: %v", tag, err)
	}
	mod := gitT(t, dir, "show", tag+":"+filepath.ToSlash(filepath.Join(m.Dir, "go.mod"))) + "\n"
	when, err := time.Parse(time.RFC3339, gitT(t, dir, "log", "-1", "--format=%cI", tag))
	if err != nil {
		t.Fatal(err)
	}
	info, _ := json.Marshal(map[string]any{"Version": v, "Time": when.UTC()})
	for name, data := range map[string][]byte{
		"list": []byte(v + "\n"), v + ".info": info, v + ".mod": []byte(mod), v + ".zip": zip.Bytes(),
	} {
		if err := os.WriteFile(filepath.Join(at, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// consumer is a scratch module of a user's, with its own module cache and
// GOBIN.
type consumer struct {
	dir, bin string
	env      []string
}

// newConsumer returns a user's empty module, whose go commands get our
// modules from the proxy on disk and every other module from this
// machine's module cache, read as a proxy, then from GOPROXY. GOFLAGS is
// empty (no -mod=mod) and go.sum starts empty, as a user's would.
func newConsumer(t *testing.T, proxy string) *consumer {
	t.Helper()
	goEnv := func(k string) string {
		out, err := exec.Command("go", "env", k).Output()
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(out))
	}
	goproxy := "file://" + filepath.ToSlash(proxy) + ",file://" + filepath.ToSlash(filepath.Join(goEnv("GOMODCACHE"), "cache", "download"))
	if up := goEnv("GOPROXY"); up != "" && up != "off" && up != "direct" {
		goproxy += "," + up
	}
	c := &consumer{dir: t.TempDir(), bin: t.TempDir()}
	c.env = append(os.Environ(),
		"GOPROXY="+goproxy,
		"GOWORK=off",
		"GOFLAGS=",
		"GOBIN="+c.bin,
		"GOTOOLCHAIN=local",
		// Our modules are in no checksum database yet, and the
		// checksum database may be out of reach: the third-party modules
		// come from this machine's module cache, checked when they were
		// first downloaded.
		"GOSUMDB=off",
		"GOMODCACHE="+consumerModCache(t),
	)
	if err := os.WriteFile(filepath.Join(c.dir, "go.mod"), []byte("module example.com/consumer\n\ngo 1.26\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return c
}

// consumerModCache returns a module cache of the consumer's own: a shared
// one could hold an earlier run's testVersion of our modules, and it would
// be used unread. The go command leaves its module cache read-only (GOFLAGS
// has no -modcacherw), so it is made writable again before the test's
// directories are removed.
func consumerModCache(t *testing.T) string {
	t.Helper()
	mc := t.TempDir()
	t.Cleanup(func() {
		filepath.WalkDir(mc, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				os.Chmod(p, 0o755)
			}
			return nil
		})
	})
	return mc
}

func (c *consumer) goCmd(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command("go", args...)
	cmd.Dir, cmd.Env = dir, c.env
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go %s in the consumer: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// section returns the lines of the README section whose heading is h, up
// to the next heading of the same level.
func section(t *testing.T, readme, h string) []string {
	t.Helper()
	b, err := os.ReadFile(readme)
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	in := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "## ") {
			if in {
				break
			}
			in = l == h
			continue
		}
		if in {
			lines = append(lines, l)
		}
	}
	if len(lines) == 0 {
		t.Fatalf("README.md has no %q section", h)
	}
	return lines
}

// readmeGoCommands returns the arguments of each `go` command line in the
// shell code blocks of the README section whose heading is h, in order.
func readmeGoCommands(t *testing.T, readme, h string) [][]string {
	t.Helper()
	var cmds [][]string
	inBlock := false
	for _, l := range section(t, readme, h) {
		switch {
		case strings.HasPrefix(l, "```"):
			inBlock = !inBlock && l == "```sh"
		case inBlock && strings.HasPrefix(strings.TrimSpace(l), "go "):
			cmds = append(cmds, strings.Fields(strings.TrimSpace(l))[1:])
		}
	}
	return cmds
}

// readmeQuickstart returns the first Go code block of the Quickstart.
func readmeQuickstart(t *testing.T, readme string) string {
	t.Helper()
	var b strings.Builder
	in := false
	for _, l := range section(t, readme, "## Quickstart") {
		switch {
		case !in && l == "```go":
			in = true
		case in && strings.HasPrefix(l, "```"):
			return b.String()
		case in:
			b.WriteString(l + "\n")
		}
	}
	t.Fatal("README.md's Quickstart has no ```go block")
	return ""
}

// scripts/apidiff.sh against two refs that differ: a base that has an
// exported function the working tree no longer has is incompatible (exit
// 3, the function named), and the release refuses a patch version over it
// while the same tree compared with itself passes.
func TestAPIDiffCatchesARemovedExportedFunction(t *testing.T) {
	dir := copyCheckout(t)
	probe := filepath.Join(dir, "releaseprobe.go")
	src := "package idempotency\n\n// ReleaseProbe exists only in the base ref of the API check's test.\nfunc ReleaseProbe() {}\n"
	if err := os.WriteFile(probe, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	gitT(t, dir, "add", "releaseprobe.go")
	gitT(t, dir, "commit", "-q", "-m", "add ReleaseProbe")
	gitT(t, dir, "tag", "v0.1.0")
	gitT(t, dir, "rm", "-q", "releaseprobe.go")
	gitT(t, dir, "commit", "-q", "-m", "remove ReleaseProbe")
	t.Setenv("APIDIFF_MODULES", ".")

	apidiff := func(base string) (string, int) {
		cmd := exec.Command(filepath.Join(dir, "scripts", "apidiff.sh"), base)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		code := 0
		if err != nil {
			ee, ok := err.(*exec.ExitError)
			if !ok {
				t.Fatal(err)
			}
			code = ee.ExitCode()
		}
		return string(out), code
	}
	out, code := apidiff("v0.1.0")
	if code != 3 || !strings.Contains(out, "ReleaseProbe") || !strings.Contains(out, "removed") {
		t.Fatalf("apidiff.sh v0.1.0 (ReleaseProbe removed since): exit %d, want 3 naming ReleaseProbe:\n%s", code, out)
	}

	// The release compares with the latest tag, v0.1.0, by default.
	rel, err := runRelease(t, "-n", "-C", dir, "v0.1.1")
	if !errors.Is(err, errIncompatible) {
		t.Fatalf("release v0.1.1 with a function removed since v0.1.0: %v, want %v\n%s", err, errIncompatible, rel)
	}

	out, code = apidiff("HEAD")
	if code != 0 || !strings.Contains(out, "no API change") {
		t.Fatalf("apidiff.sh HEAD on a clean tree: exit %d, want 0:\n%s", code, out)
	}
}
