#!/usr/bin/env bash
# Writes a directory that `gcloud functions deploy --source=DIR` (or
# `gcloud run deploy --source=DIR --function=...`, or, for the net/http
# service in cmd/cloudrun, `gcloud run deploy --source=DIR
# --set-build-env-vars=GOOGLE_BUILDABLE=./cmd/cloudrun`) can build on its
# own: the example's function package, the service's main, a go.mod of its
# own, and a vendor/ directory
# that holds this module (which is not published on a module proxy) and
# every other dependency. Cloud Build then needs nothing outside DIR.
#
#   scripts/function-source.sh [DIR]     (default: build/function)
#
# With IDEMPOTENCY_VERSION=vX.Y.Z set, the go.mod requires that released
# version of each module instead, with no replace directive: what a user
# deploying a published release writes (the modules then come from the
# module proxy; internal/release's test serves them from a proxy on disk).
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
# The same directory builds the plain net/http Cloud Run service too:
# gcloud run deploy --source=DIR --set-build-env-vars=GOOGLE_BUILDABLE=./cmd/cloudrun
mkdir -p "$out/cmd/cloudrun"
cp "$repo/function_example/cmd/cloudrun/main.go" "$out/cmd/cloudrun/"
M=github.com/gcp-pubsub-idempotency/idempotency
# The function needs the root module, every backend module it may pick at
# run time (IDEMPOTENCY_BACKEND) and the example's module (its orders
# package); each is replaced by this checkout's copy (or, with
# IDEMPOTENCY_VERSION, required at that release) and then vendored.
{
	printf 'module example.com/orders-function\n\ngo 1.26\n\nrequire (\n'
	printf '\t%s '"${IDEMPOTENCY_VERSION:-v0.0.0-00010101000000-000000000000}"'\n' "$M" "$M/store/datastorelock" "$M/store/redislock" "$M/store/sqllock" "$M/function_example"
	printf ')\n'
	if [ -z "${IDEMPOTENCY_VERSION:-}" ]; then
		printf '\n// Only vendor/ is read when building: go build uses it whenever it exists.\nreplace (\n'
		printf '\t%s => %s\n' "$M" "$repo"
		for m in store/datastorelock store/redislock store/sqllock function_example; do
			printf '\t%s => %s\n' "$M/$m" "$repo/$m"
		done
		printf ')\n'
	fi
} >"$out/go.mod"
cd "$out"
# The directory is a module of its own, outside this repository's go.work.
export GOWORK=off
go mod tidy
go mod vendor
echo "wrote $out ($(du -sh "$out" | cut -f1)); deploy it with --source=$out"
