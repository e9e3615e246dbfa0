#!/usr/bin/env bash
# Writes a directory that `gcloud functions deploy --source=DIR` (or
# `gcloud run deploy --source=DIR --function=...`) can build on its own: the
# example's function package, a go.mod of its own, and a vendor/ directory
# that holds this module (which is not published on a module proxy) and
# every other dependency. Cloud Build then needs nothing outside DIR.
#
#   scripts/function-source.sh [DIR]     (default: build/function)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$repo/build/function}
case "$(realpath -m "$out")" in
"$repo" | / | "$HOME")
	echo "function-source.sh: refusing to write into $out" >&2
	exit 2
	;;
esac
rm -rf "$out"
mkdir -p "$out"
out=$(cd "$out" && pwd)
cp "$repo/function_example/function.go" "$repo/function_example/buildpack.go" "$out/"
cat >"$out/go.mod" <<GOMOD
module example.com/orders-function

go 1.26

require github.com/gcp-pubsub-idempotency/idempotency v0.0.0-00010101000000-000000000000

// Only vendor/ is read when building: go build uses it whenever it exists.
replace github.com/gcp-pubsub-idempotency/idempotency => $repo
GOMOD
cd "$out"
go mod tidy
go mod vendor
echo "wrote $out ($(du -sh "$out" | cut -f1)); deploy it with --source=$out"
