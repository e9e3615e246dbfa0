#!/usr/bin/env bash
# Fails if any module's go.mod or go.sum is not what `go mod tidy` would
# write, each module judged on its own (GOWORK=off), as a user's build
# would read it. Prints the difference. With FIX=1, rewrites them instead.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export GOWORK=off
rc=0
while IFS= read -r mod; do
	dir=$(dirname "$mod")
	if [ -n "${FIX:-}" ]; then
		(cd "$dir" && go mod tidy)
	elif ! out=$(cd "$dir" && go mod tidy -diff 2>&1); then
		echo "${dir#"$root"/}: go.mod/go.sum are not tidy (run FIX=1 scripts/tidy.sh):"
		echo "$out"
		rc=1
	fi
done < <(find "$root" -name go.mod -not -path '*/build/*' -not -path '*/vendor/*' -not -path '*/testdata/*' | sort)
exit $rc
