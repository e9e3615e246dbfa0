#!/usr/bin/env bash
# Runs every Go fuzz target (func FuzzXxx(*testing.F)) of every package of
# every module in this repository, one after the other, and prints how many
# executions each ran.
#
#   FUZZTIME      how long each target runs: a duration (10s, 5m) or an
#                 execution count (1000000x). Default 1000000x: one million
#                 executions per target, however fast the machine is.
#   FUZZPARALLEL  fuzzing workers per target (go test -parallel); default
#                 GOMAXPROCS.
#   FUZZRUN       only targets whose name matches this regexp (default all).
#   FUZZMINIMIZETIME  how long Go may spend minimizing each new input
#                 (-fuzzminimizetime); default 5s instead of Go's 60s, which
#                 on a loaded machine spends most of a run minimizing.
#
# Targets are found, not listed here: a package whose test files mention
# *testing.F is asked for them with `go test -list '^Fuzz'`, so a new target
# in any package is picked up without editing this script. Seed corpora
# come from each package's testdata/ (the target's f.Add calls, and the
# inputs Go keeps in testdata/fuzz/FuzzXxx/, where a crasher is written).
# Exits non-zero if any target fails or no target is found.
set -uo pipefail

FUZZTIME=${FUZZTIME:-1000000x}
FUZZRUN=${FUZZRUN:-.}
FUZZMINIMIZETIME=${FUZZMINIMIZETIME:-5s}
parallel=()
if [ -n "${FUZZPARALLEL:-}" ]; then parallel=(-parallel "$FUZZPARALLEL"); fi

root=$(cd "$(dirname "$0")/.." && pwd)
log=$(mktemp)
trap 'rm -f "$log"' EXIT

summary=()
failed=0
found=0
# Every module: the root one and any nested go.mod (go list ./... stops at
# a nested module's boundary, so each is listed from its own directory).
while IFS= read -r mod; do
	moddir=$(dirname "$mod")
	while read -r dir pkg files; do
		[ -n "$files" ] || continue
		(cd "$dir" && grep -lq '\*testing\.F\b' $files) || continue
		targets=$(cd "$moddir" && go test -run '^$' -list '^Fuzz' "$pkg" 2>&1 | grep -E '^Fuzz[A-Za-z0-9_]*$' | grep -E -- "$FUZZRUN")
		for t in $targets; do
			found=$((found + 1))
			echo "=== $pkg $t (FUZZTIME=$FUZZTIME)"
			start=$SECONDS
			for attempt in 1 2; do
				(cd "$moddir" && go test -run '^$' -fuzz "^$t\$" -fuzztime "$FUZZTIME" -fuzzminimizetime "$FUZZMINIMIZETIME" "${parallel[@]}" "$pkg") >"$log" 2>&1
				rc=$?
				grep -E 'fuzz: elapsed|^(ok|PASS|FAIL)' "$log" | tail -n 4
				[ "$rc" -ne 0 ] || break
				# A failure prints everything from its --- FAIL line on,
				# unfiltered: the fuzzer's own message, our t.Fatalf, a
				# panic's stack, or where the failing input was written.
				sed -n '/^--- FAIL/,$p' "$log" | head -n 80
				# Go's coordinator can report its own -fuzztime deadline
				# as a failure ("context deadline exceeded", no input
				# written) when the timer fires between cancelling its
				# context and that context's child. Only that exact
				# shape is retried, once; every other failure counts.
				body=$(sed -n '/^--- FAIL/,$p' "$log" | grep -Ev '^(--- FAIL|FAIL|exit status)' | grep -v '^[[:space:]]*$')
				if [ "$attempt" -eq 1 ] && [ "$(echo "$body" | sed 's/^[[:space:]]*//')" = "context deadline exceeded" ]; then
					echo "    (the fuzzer's own -fuzztime deadline race, no input failed: running $t once more)"
					continue
				fi
				break
			done
			execs=$(grep -Eo 'execs: [0-9]+' "$log" | tail -n 1 | grep -Eo '[0-9]+')
			status=ok
			if [ "$rc" -ne 0 ]; then status=FAIL; failed=$((failed + 1)); fi
			summary+=("$(printf '%-4s %-52s %-24s %12s execs %5ss' "$status" "$pkg" "$t" "${execs:-?}" "$((SECONDS - start))")")
		done
	done < <(cd "$moddir" && go list -f '{{.Dir}} {{.ImportPath}} {{join .TestGoFiles " "}} {{join .XTestGoFiles " "}}' ./...)
done < <(find "$root" -name go.mod -not -path '*/build/*' -not -path '*/vendor/*' -not -path '*/testdata/*' | sort)

echo
echo "fuzz summary (FUZZTIME=$FUZZTIME):"
printf '%s\n' "${summary[@]}"
if [ "$found" -eq 0 ]; then
	echo "no fuzz targets found" >&2
	exit 1
fi
if [ "$failed" -ne 0 ]; then
	echo "$failed of $found fuzz targets failed; crashers are under the package's testdata/fuzz/" >&2
	exit 1
fi
echo "$found fuzz targets, 0 failures"
