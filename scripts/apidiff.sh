#!/usr/bin/env bash
# Compares the exported API of every module of this checkout (the working
# tree, uncommitted changes included) with the same module at a base git
# ref, and fails if a change would break a user's code: a removed or
# changed exported identifier, a removed package or module.
#
#   scripts/apidiff.sh [BASE]     (make apidiff BASE=ref)
#
# BASE defaults to the latest release tag (vX.Y.Z); with no tag yet there
# is nothing to compare with, and it says so and exits 0.
# APIDIFF_MODULES limits the check to some module directories ("." is the
# root module; default: every module not under an internal/ directory).
#
# The tool is golang.org/x/exp/cmd/apidiff at the pinned version below,
# built from the module proxy. Each module is loaded on its own
# (GOWORK=off), the base's from `git archive BASE`, so each side builds
# against its own siblings (the replace directives in its go.mod).
#
# Exit status: 0 compatible (compatible additions are listed), 3
# incompatible changes (listed), anything else: the check could not run.
# APIDIFF_WARN=1 (make test) lists incompatible changes and exits 0: before
# v1 a new minor version may break, and the release decides.
# go run ./internal/release runs it before a release and accepts
# incompatible changes only with a new minor version (v0) or major version.
set -euo pipefail
APIDIFF_VERSION=v0.0.0-20261113113407-e3970619a1a4 # golang.org/x/exp
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

base=${1:-}
if [ -z "$base" ]; then
	base=$(git tag --list 'v*' --sort=-v:refname | grep -E '^v[0-9]+\.[0-9]+\.[0-9]+$' | head -n 1 || true)
	if [ -z "$base" ]; then
		echo "apidiff: no release tag (vX.Y.Z) yet, nothing to compare with; name a ref to compare with one: make apidiff BASE=<ref>"
		exit 0
	fi
fi
git rev-parse -q --verify "$base^{commit}" >/dev/null || {
	echo "apidiff: $base is not a commit of this repository" >&2
	exit 2
}

tmp=$(mktemp -d)
trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
GOBIN=$tmp/bin GOWORK=off GOFLAGS= go install "golang.org/x/exp/cmd/apidiff@$APIDIFF_VERSION"
apidiff=$tmp/bin/apidiff
mkdir -p "$tmp/base"
git archive "$base" | tar -x -C "$tmp/base"
export GOWORK=off GOFLAGS=-mod=mod

modules() { # the module directories under $1, relative, internal/ ones left out
	(cd "$1" && find . -name go.mod -not -path '*/build/*' -not -path '*/vendor/*' -not -path '*/testdata/*' |
		sed -e 's#^\./##' -e 's#/\{0,1\}go\.mod$##' -e 's#^$#.#' | grep -Ev '(^|/)internal(/|$)' | sort)
}
if [ -n "${APIDIFF_MODULES:-}" ]; then
	dirs=$(printf '%s\n' $APIDIFF_MODULES | sort -u)
else
	dirs=$( (modules "$tmp/base" && modules "$root") | sort -u)
fi

incompatible=()
for dir in $dirs; do
	old=$tmp/base/$dir new=$root/$dir
	if [ ! -f "$new/go.mod" ]; then
		echo "== $dir: the module was removed since $base"
		incompatible+=("$dir")
		continue
	fi
	if [ ! -f "$old/go.mod" ]; then
		echo "== $dir: a new module since $base"
		continue
	fi
	path=$(cd "$new" && go list -m)
	(cd "$old" && "$apidiff" -m -w "$tmp/old.export" "$(go list -m)") 2> >(grep -v "^Ignoring internal package" >&2)
	(cd "$new" && "$apidiff" -m -w "$tmp/new.export" "$path") 2> >(grep -v "^Ignoring internal package" >&2)
	report=$("$apidiff" -m "$tmp/old.export" "$tmp/new.export")
	bad=$("$apidiff" -m -incompatible "$tmp/old.export" "$tmp/new.export")
	if [ -n "$bad" ]; then
		echo "== $dir ($path): INCOMPATIBLE changes since $base"
		echo "$report"
		incompatible+=("$dir")
	elif [ -n "$report" ]; then
		echo "== $dir ($path): compatible changes since $base"
		echo "$report"
	else
		echo "== $dir ($path): no API change since $base"
	fi
done
if ((${#incompatible[@]})); then
	echo "apidiff: incompatible API changes since $base in: ${incompatible[*]}"
	if [ -n "${APIDIFF_WARN:-}" ]; then
		echo "apidiff: WARNING only (APIDIFF_WARN): the next release must be a new minor version (v0) or major version"
		exit 0
	fi
	exit 3
fi
echo "apidiff: every module is compatible with $base"
