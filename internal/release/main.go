// Command release prepares a release of every module of this repository
// at one version (one module set, as OpenTelemetry Go's versions.yaml and
// gocloud's allmodules list keep theirs; here the set is every go.mod found
// in the repository, so a new module joins it without an edit here).
//
//	go run ./internal/release [-n] [-base REF] [-date YYYY-MM-DD] VERSION
//	go run ./internal/release -sync VERSION
//
// It finds every go.mod, sets each requirement of one of our modules on
// another to VERSION (adding a replace directive to the other's directory
// where one is missing), renames CHANGELOG.md's "## [Unreleased]" section
// to "## [VERSION] - DATE" under a new empty Unreleased heading, checks that
// every go.mod is tidy (scripts/tidy.sh) and that the API changes since the
// last release fit VERSION (scripts/apidiff.sh), commits, and tags the
// commit once per released module: VERSION for the root module, DIR/VERSION
// for the module in DIR. Modules under an internal/ directory are not
// tagged. It never pushes: it prints the git push commands, root module
// first, then each module after every module it requires (see
// docs/develop.md, "Releasing").
//
// With -n it changes nothing: it prints the diff it would commit, the tags
// and the push commands. With -sync it only sets the versions in the
// go.mod files (for a module that joined the set since the last release).
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/mod/semver"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
}

// errIncompatible is returned when scripts/apidiff.sh found incompatible
// API changes that the chosen version does not allow.
var errIncompatible = errors.New("incompatible API changes")

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("release", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dryRun := fs.Bool("n", false, "dry run: print the diff, the tags and the push commands; change nothing")
	sync := fs.Bool("sync", false, "only set every go.mod's requirements on our modules to VERSION")
	dir := fs.String("C", ".", "a directory inside the repository")
	date := fs.String("date", time.Now().UTC().Format(time.DateOnly), "the release date written to CHANGELOG.md")
	base := fs.String("base", "", "the ref to compare the API with (default: the latest release tag; none: skip)")
	remote := fs.String("remote", "origin", "the remote named in the printed push commands")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: go run ./internal/release [-n] [-base REF] [-date YYYY-MM-DD] VERSION\n       go run ./internal/release -sync VERSION")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return errors.New("want exactly one VERSION")
	}
	v := fs.Arg(0)
	if !semver.IsValid(v) || semver.Canonical(v) != v || semver.Build(v) != "" {
		return fmt.Errorf("%q is not a release version (vMAJOR.MINOR.PATCH, optionally -prerelease)", v)
	}
	if semver.Major(v) != "v0" && semver.Major(v) != "v1" {
		return fmt.Errorf("%s: a major version above v1 needs a /%s suffix on every module path first", v, semver.Major(v))
	}
	if _, err := time.Parse(time.DateOnly, *date); err != nil {
		return fmt.Errorf("-date: %v", err)
	}
	root, err := git(*dir, "rev-parse", "--show-toplevel")
	if err != nil {
		return err
	}
	mods, err := discover(root)
	if err != nil {
		return err
	}
	levels, err := tagOrder(mods)
	if err != nil {
		return err
	}
	changed, err := setVersions(mods, v)
	if err != nil {
		return err
	}
	if *sync {
		if *dryRun {
			return printDiff(stdout, root, changed, nil)
		}
		for m, data := range changed {
			if err := os.WriteFile(filepath.Join(root, m.Dir, "go.mod"), data, 0o644); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "%s/go.mod: requires our modules at %s\n", m.Dir, v)
		}
		return nil
	}

	// The version must be new and above every earlier release.
	tags, err := git(root, "tag", "--list", "v*")
	if err != nil {
		return err
	}
	last := ""
	for t := range strings.FieldsSeq(tags) {
		if t == v {
			return fmt.Errorf("%s is already tagged", v)
		}
		if semver.IsValid(t) && semver.Prerelease(t) == "" && (last == "" || semver.Compare(t, last) > 0) {
			last = t
		}
	}
	if last != "" && semver.Compare(v, last) <= 0 {
		return fmt.Errorf("%s is not above the latest release %s", v, last)
	}
	if !*dryRun {
		st, err := git(root, "status", "--porcelain", "--untracked-files=no")
		if err != nil {
			return err
		}
		if st != "" {
			return fmt.Errorf("the working tree has uncommitted changes; commit or stash them first:\n%s", st)
		}
	}

	clPath := filepath.Join(root, "CHANGELOG.md")
	cl, err := os.ReadFile(clPath)
	if err != nil {
		return err
	}
	newCL, err := releaseChangelog(cl, v, *date)
	if err != nil {
		return err
	}

	// API compatibility with the base release.
	if *base == "" {
		*base = last
	}
	if *base == "none" {
		*base = ""
	}
	if *base == "" {
		fmt.Fprintln(stdout, "API check: no earlier release tag, nothing to compare with")
	} else if err := checkAPI(root, *base, v, stdout); err != nil {
		return err
	}

	var tagList []string
	for _, l := range levels {
		for _, m := range l {
			tagList = append(tagList, m.Tag(v))
		}
	}
	gomods, err := releaseGoMods(mods, changed)
	if err != nil {
		return err
	}
	if *dryRun {
		shown := map[*Module][]byte{}
		for m, g := range gomods {
			if !bytes.Equal(g.released, m.Data) {
				shown[m] = g.released
			}
		}
		if err := printDiff(stdout, root, shown, newCL); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "\ndry run: would commit %q (every released go.mod without its replace directives) and create these tags on it, in this order:\n", "release: "+v)
		for _, t := range tagList {
			fmt.Fprintf(stdout, "  %s\n", t)
		}
		fmt.Fprintf(stdout, "then commit %q (the replace directives back, for development)\n", devCommit(v))
		printPush(stdout, root, *remote, levels, v)
		return nil
	}

	for m, data := range changed {
		if err := os.WriteFile(filepath.Join(root, m.Dir, "go.mod"), data, 0o644); err != nil {
			return err
		}
	}
	if err := os.WriteFile(clPath, newCL, 0o644); err != nil {
		return err
	}
	if tidy := filepath.Join(root, "scripts", "tidy.sh"); fileExists(tidy) {
		cmd := exec.Command(tidy)
		cmd.Dir, cmd.Stdout, cmd.Stderr = root, stdout, stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("scripts/tidy.sh after setting the versions: %v (the edits are left uncommitted; `git checkout -- .` undoes them)", err)
		}
	}
	// The release commit: every released go.mod without the replace
	// directives to this checkout, which `go install MODULE/cmd@VERSION`
	// refuses (and a consumer ignores anyway). The next commit puts them
	// back for development with GOWORK=off (scripts/tidy.sh).
	files := []string{"CHANGELOG.md"}
	dev := map[string][]byte{}
	for _, m := range mods {
		rel := filepath.ToSlash(filepath.Join(m.Dir, "go.mod"))
		g := gomods[m]
		if !bytes.Equal(g.released, g.dev) {
			dev[rel] = g.dev
			if err := os.WriteFile(filepath.Join(root, m.Dir, "go.mod"), g.released, 0o644); err != nil {
				return err
			}
		}
		if !bytes.Equal(g.released, m.Data) {
			files = append(files, rel)
		}
	}
	if _, err := git(root, append([]string{"add", "--"}, files...)...); err != nil {
		return err
	}
	if _, err := git(root, "commit", "-q", "-m", "release: "+v, "-m", "Every module of the set at "+v+" (go run ./internal/release), with no replace directive in a released go.mod."); err != nil {
		return err
	}
	release, err := git(root, "rev-parse", "HEAD")
	if err != nil {
		return err
	}
	for _, l := range levels {
		for _, m := range l {
			if _, err := git(root, "tag", "-a", m.Tag(v), "-m", m.Path+" "+v, release); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "tagged %s\n", m.Tag(v))
		}
	}
	if len(dev) > 0 {
		var devFiles []string
		for rel, data := range dev {
			if err := os.WriteFile(filepath.Join(root, filepath.FromSlash(rel)), data, 0o644); err != nil {
				return err
			}
			devFiles = append(devFiles, rel)
		}
		slices.Sort(devFiles)
		if _, err := git(root, append([]string{"add", "--"}, devFiles...)...); err != nil {
			return err
		}
		if _, err := git(root, "commit", "-q", "-m", devCommit(v), "-m", "The replace directives to this checkout, for builds with GOWORK=off (scripts/tidy.sh); the tags stay on the release commit, whose go.mod files have none."); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "committed %q after the tagged commit\n", devCommit(v))
	}
	printPush(stdout, root, *remote, levels, v)
	return nil
}

// goMods is a module's go.mod at the release: dev, with the versions set
// (and the replace directives to this checkout), and released, as the
// tagged commit holds it.
type goMods struct{ dev, released []byte }

// releaseGoMods returns each module's go.mods at the release, given the
// go.mod files setVersions changed.
func releaseGoMods(mods []*Module, changed map[*Module][]byte) (map[*Module]goMods, error) {
	out := map[*Module]goMods{}
	for _, m := range mods {
		dev, ok := changed[m]
		if !ok {
			dev = m.Data
		}
		released, err := releasedGoMod(m, mods, dev)
		if err != nil {
			return nil, err
		}
		out[m] = goMods{dev, released}
	}
	return out, nil
}

// devCommit is the subject of the commit after the release's, which puts
// the replace directives back.
func devCommit(v string) string { return "release: " + v + ", replace directives back for development" }

// releaseChangelog renames the Unreleased section to v, dated, and opens a
// new empty Unreleased section above it.
func releaseChangelog(cl []byte, v, date string) ([]byte, error) {
	const unreleased = "## [Unreleased]\n"
	if bytes.Contains(cl, []byte("## ["+v+"]")) {
		return nil, fmt.Errorf("CHANGELOG.md already has a %s section", v)
	}
	i := bytes.Index(cl, []byte(unreleased))
	if i < 0 || (i > 0 && cl[i-1] != '\n') {
		return nil, errors.New(`CHANGELOG.md has no "## [Unreleased]" heading`)
	}
	rest := cl[i+len(unreleased):]
	if next := bytes.Index(rest, []byte("\n## ")); !bytes.Contains(sectionOf(rest, next), []byte("\n- ")) {
		return nil, errors.New("CHANGELOG.md's Unreleased section lists no change: nothing to release")
	}
	var b bytes.Buffer
	b.Write(cl[:i])
	b.WriteString(unreleased)
	fmt.Fprintf(&b, "\n## [%s] - %s\n", v, date)
	b.Write(rest)
	return b.Bytes(), nil
}

func sectionOf(rest []byte, next int) []byte {
	if next < 0 {
		return append([]byte("\n"), rest...)
	}
	return append([]byte("\n"), rest[:next]...)
}

// checkAPI runs scripts/apidiff.sh against base and fails when it finds
// incompatible changes that v does not allow: from v0.x a new minor (or
// major) version, from v1 and later a new major version.
func checkAPI(root, base, v string, stdout io.Writer) error {
	cmd := exec.Command(filepath.Join(root, "scripts", "apidiff.sh"), base)
	cmd.Dir, cmd.Stdout, cmd.Stderr = root, stdout, stdout
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &exit) && exit.ExitCode() == 3:
	default:
		return fmt.Errorf("scripts/apidiff.sh %s: %v", base, err)
	}
	allowed := semver.Major(v) != semver.Major(base)
	if semver.Major(base) == "v0" {
		allowed = allowed || semver.MajorMinor(v) != semver.MajorMinor(base)
	}
	if !allowed {
		return fmt.Errorf("%w since %s: %s would break users; release a new %s version instead", errIncompatible, base, v,
			map[bool]string{true: "minor (v0)", false: "major"}[semver.Major(base) == "v0"])
	}
	fmt.Fprintf(stdout, "API check: incompatible changes since %s, allowed by %s\n", base, v)
	return nil
}

// printDiff prints, for each file the release would change, a unified diff.
func printDiff(w io.Writer, root string, changed map[*Module][]byte, changelog []byte) error {
	type edit struct {
		rel  string
		data []byte
	}
	var edits []edit
	for m, data := range changed {
		edits = append(edits, edit{filepath.ToSlash(filepath.Join(m.Dir, "go.mod")), data})
	}
	slices.SortFunc(edits, func(a, b edit) int { return strings.Compare(a.rel, b.rel) })
	if changelog != nil {
		edits = append(edits, edit{"CHANGELOG.md", changelog})
	}
	tmp, err := os.MkdirTemp("", "release-dry-run")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	for i, e := range edits {
		p := filepath.Join(tmp, fmt.Sprint(i))
		if err := os.WriteFile(p, e.data, 0o644); err != nil {
			return err
		}
		cmd := exec.Command("git", "diff", "--no-index", "--no-color", "--", filepath.Join(root, e.rel), p)
		out, _ := cmd.Output() // exit 1: the files differ
		s := strings.ReplaceAll(string(out), filepath.Join(root, e.rel), "/"+e.rel)
		s = strings.ReplaceAll(s, p, "/"+e.rel)
		fmt.Fprint(w, s)
	}
	if len(edits) == 0 {
		fmt.Fprintln(w, "no go.mod changes")
	}
	return nil
}

// printPush prints the commands that publish the release: the branch, then
// the tags level by level, the root module's first.
func printPush(w io.Writer, root, remote string, levels [][]*Module, v string) {
	branch, err := git(root, "symbolic-ref", "--short", "-q", "HEAD")
	if err != nil || branch == "" {
		branch = "HEAD:main"
	}
	fmt.Fprintf(w, "\nNothing was pushed. To publish %s, run these in order (each tag only after the tags of the modules it requires):\n", v)
	fmt.Fprintf(w, "  git push %s %s\n", remote, branch)
	for _, l := range levels {
		var tags []string
		for _, m := range l {
			tags = append(tags, m.Tag(v))
		}
		fmt.Fprintf(w, "  git push %s %s\n", remote, strings.Join(tags, " "))
	}
}

func git(dir string, args ...string) (string, error) {
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("git %s: %v\n%s", strings.Join(args, " "), err, stderr.Bytes())
	}
	return strings.TrimSpace(string(out)), nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
