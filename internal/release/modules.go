package main

import (
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
)

// Module is one go.mod of the repository.
type Module struct {
	Dir  string // relative to the repository root, slash-separated; "." for the root module
	Path string // its module path
	File *modfile.File
	Data []byte // the go.mod as read
}

// Released reports whether the release tags m. A module under an internal/
// directory is not tagged: no package outside this repository can import
// it (tests, benchmarks, the release tool itself).
func (m *Module) Released() bool {
	return !slices.Contains(strings.Split(m.Dir, "/"), "internal")
}

// Tag is the git tag that versions m at version v: the version alone for
// the root module, the module's directory and the version otherwise (what
// the go command looks for in a repository holding several modules).
func (m *Module) Tag(v string) string {
	if m.Dir == "." {
		return v
	}
	return m.Dir + "/" + v
}

// skipDir reports whether discovery ignores a directory: the go command
// ignores names starting with "." or "_" and testdata; build/ holds
// generated copies (scripts/function-source.sh) and vendor/ vendored ones.
func skipDir(name string) bool {
	return strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") ||
		name == "testdata" || name == "vendor" || name == "build"
}

// discover finds every go.mod under root, the root module first and then
// by directory. Each module's path must be the root module's path joined
// with its directory: that is what lets the go command find a tag
// "dir/vX.Y.Z" for it.
func discover(root string) ([]*Module, error) {
	var mods []*Module
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && skipDir(d.Name()) {
				return filepath.SkipDir
			}
			return nil
		}
		if d.Name() != "go.mod" {
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		f, err := modfile.Parse(p, data, nil)
		if err != nil {
			return err
		}
		if f.Module == nil {
			return fmt.Errorf("%s: no module statement", p)
		}
		rel, err := filepath.Rel(root, filepath.Dir(p))
		if err != nil {
			return err
		}
		mods = append(mods, &Module{Dir: filepath.ToSlash(rel), Path: f.Module.Mod.Path, File: f, Data: data})
		return nil
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(mods, func(a, b *Module) int {
		if (a.Dir == ".") != (b.Dir == ".") {
			if a.Dir == "." {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Dir, b.Dir)
	})
	if len(mods) == 0 || mods[0].Dir != "." {
		return nil, fmt.Errorf("%s has no go.mod at its root", root)
	}
	rootPath := mods[0].Path
	for _, m := range mods[1:] {
		if want := rootPath + "/" + m.Dir; m.Path != want {
			return nil, fmt.Errorf("%s/go.mod: module %s, want %s (the path of its directory, so that its tag %s resolves)", m.Dir, m.Path, want, m.Tag("vX.Y.Z"))
		}
	}
	return mods, nil
}

// siblings returns, for each module, the modules of this repository it
// requires (directly or indirectly in its go.mod).
func siblings(mods []*Module) map[*Module][]*Module {
	byPath := map[string]*Module{}
	for _, m := range mods {
		byPath[m.Path] = m
	}
	deps := map[*Module][]*Module{}
	for _, m := range mods {
		for _, r := range m.File.Require {
			if d := byPath[r.Mod.Path]; d != nil {
				deps[m] = append(deps[m], d)
			}
		}
	}
	return deps
}

// tagOrder groups the released modules into levels: level 0 is every
// module that requires no other of ours (the root module), level n the
// modules whose requirements are all in earlier levels. A level's tags are
// pushed only after every earlier level's, so a version is never visible
// on the module proxy before the versions its go.mod requires.
func tagOrder(mods []*Module) ([][]*Module, error) {
	deps := siblings(mods)
	level := map[*Module]int{}
	var visit func(m *Module, stack []*Module) (int, error)
	visit = func(m *Module, stack []*Module) (int, error) {
		if l, ok := level[m]; ok {
			return l, nil
		}
		if slices.Contains(stack, m) {
			return 0, fmt.Errorf("the modules require each other in a cycle: %v", pathsOf(append(stack, m)))
		}
		l := 0
		for _, d := range deps[m] {
			dl, err := visit(d, append(stack, m))
			if err != nil {
				return 0, err
			}
			l = max(l, dl+1)
		}
		level[m] = l
		return l, nil
	}
	var levels [][]*Module
	for _, m := range mods {
		if !m.Released() {
			continue
		}
		l, err := visit(m, nil)
		if err != nil {
			return nil, err
		}
		for len(levels) <= l {
			levels = append(levels, nil)
		}
		levels[l] = append(levels[l], m)
	}
	return levels, nil
}

func pathsOf(mods []*Module) []string {
	var s []string
	for _, m := range mods {
		s = append(s, m.Path)
	}
	return s
}

// setVersions points every requirement of one of our modules on another at
// version v and gives each such requirement a replace directive to the
// other module's directory, so that the module still builds and tidies
// against this checkout with GOWORK=off and no network (a consumer ignores
// replace directives: it gets the tagged version). It returns the new
// contents of each go.mod that changed.
func setVersions(mods []*Module, v string) (map[*Module][]byte, error) {
	deps := siblings(mods)
	changed := map[*Module][]byte{}
	for _, m := range mods {
		for _, d := range deps[m] {
			// An unreleased module may require a released one (a test of
			// it), never the other way around.
			if m.Released() && !d.Released() {
				return nil, fmt.Errorf("%s requires %s, which is not released (it is under an internal/ directory): a consumer could not resolve it", m.Path, d.Path)
			}
			if err := m.File.AddRequire(d.Path, v); err != nil {
				return nil, err
			}
			if !hasReplace(m.File, d.Path) {
				rel, err := filepath.Rel(filepath.FromSlash(m.Dir), filepath.FromSlash(d.Dir))
				if err != nil {
					return nil, err
				}
				rel = filepath.ToSlash(rel)
				if !strings.HasPrefix(rel, ".") {
					rel = "./" + rel
				}
				if err := m.File.AddReplace(d.Path, "", path.Clean(rel), ""); err != nil {
					return nil, err
				}
			}
		}
		m.File.Cleanup()
		out, err := m.File.Format()
		if err != nil {
			return nil, err
		}
		if string(out) != string(m.Data) {
			changed[m] = out
		}
	}
	return changed, nil
}

// releasedGoMod returns data, m's go.mod, as the release commit holds it:
// for a released module, without the replace directives of our modules
// (the go command refuses `go install m/cmd@v` of a module whose go.mod
// has a replace directive, and a consumer ignores them anyway). An
// unreleased module keeps them.
func releasedGoMod(m *Module, mods []*Module, data []byte) ([]byte, error) {
	if !m.Released() {
		return data, nil
	}
	f, err := modfile.Parse(filepath.Join(m.Dir, "go.mod"), data, nil)
	if err != nil {
		return nil, err
	}
	ours := pathsOf(mods)
	for _, r := range slices.Clone(f.Replace) {
		if slices.Contains(ours, r.Old.Path) {
			if err := f.DropReplace(r.Old.Path, r.Old.Version); err != nil {
				return nil, err
			}
		}
	}
	f.Cleanup()
	if len(f.Replace) > 0 {
		return nil, fmt.Errorf("%s/go.mod replaces %s: a released module cannot (go install refuses it)", m.Dir, f.Replace[0].Old.Path)
	}
	return f.Format()
}

// hasReplace reports whether f replaces every version of p.
func hasReplace(f *modfile.File, p string) bool {
	for _, r := range f.Replace {
		if r.Old.Path == p && r.Old.Version == "" {
			return true
		}
	}
	return false
}

// checkSet reports what keeps mods from being a module set at version v:
// a requirement of one of ours on another at a different version, or one
// without a replace directive to this checkout.
func checkSet(mods []*Module, v string) []string {
	var problems []string
	deps := siblings(mods)
	for _, m := range mods {
		for _, d := range deps[m] {
			for _, r := range m.File.Require {
				if r.Mod.Path == d.Path && r.Mod.Version != v {
					problems = append(problems, fmt.Sprintf("%s/go.mod requires %s %s, not %s", m.Dir, d.Path, r.Mod.Version, v))
				}
			}
			if !hasReplace(m.File, d.Path) {
				problems = append(problems, fmt.Sprintf("%s/go.mod requires %s without a replace directive to its directory", m.Dir, d.Path))
			}
			if m.Released() && !d.Released() {
				problems = append(problems, fmt.Sprintf("%s is released but requires %s, which is not", m.Path, d.Path))
			}
		}
	}
	return problems
}

// setVersion returns the one version at which the modules require each
// other, or "" when none requires another, or an error when they disagree.
func setVersion(mods []*Module) (string, error) {
	deps := siblings(mods)
	seen := map[string][]string{}
	for _, m := range mods {
		for _, d := range deps[m] {
			for _, r := range m.File.Require {
				if r.Mod.Path == d.Path {
					seen[r.Mod.Version] = append(seen[r.Mod.Version], m.Dir+" -> "+d.Dir)
				}
			}
		}
	}
	switch len(seen) {
	case 0:
		return "", nil
	case 1:
		for v := range seen {
			if !module.IsPseudoVersion(v) {
				return v, nil
			}
			return "", fmt.Errorf("the modules require each other at the pseudo-version %s, not a release", v)
		}
	}
	return "", fmt.Errorf("the modules require each other at several versions: %v", seen)
}
