#!/usr/bin/env bash
# Installs the servers the backend tests run against, when they are missing.
# Tests start their own instances on free loopback ports; nothing is started
# here. Needs root (or sudo) for apt-get; otherwise says what to install.
set -euo pipefail

pkgs=()
command -v redis-server >/dev/null 2>&1 || pkgs+=(redis-server)
command -v java >/dev/null 2>&1 || pkgs+=(openjdk-17-jre-headless) # the Datastore emulator
command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ] || pkgs+=(mariadb-server)
if ! command -v initdb >/dev/null 2>&1 && [ ! -x /usr/local/bin/initdb ] &&
	! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
	pkgs+=(postgresql)
fi
# libfaketime: the contract suite's server clock that jumps runs PostgreSQL
# and MariaDB under it.
compgen -G '/usr/lib/*/faketime/libfaketime.so.1' >/dev/null ||
	compgen -G '/usr/local/lib/faketime/libfaketime.so.1' >/dev/null || pkgs+=(libfaketime)

sdk=/usr/lib/google-cloud-sdk/platform
if [ -z "${DATASTORE_EMULATOR_HOST:-}" ] && [ ! -x "$sdk/cloud-datastore-emulator/cloud_datastore_emulator" ]; then
	echo "the Datastore emulator is missing: install the Google Cloud SDK component" \
		"(gcloud components install cloud-datastore-emulator, or the" \
		"google-cloud-cli-datastore-emulator package) or set DATASTORE_EMULATOR_HOST" >&2
	exit 1
fi
if [ -z "${PUBSUB_EMULATOR_HOST:-}" ] && [ ! -x "$sdk/pubsub-emulator/bin/cloud-pubsub-emulator" ]; then
	echo "the Pub/Sub emulator is missing: install the Google Cloud SDK component" \
		"(gcloud components install pubsub-emulator, or the" \
		"google-cloud-cli-pubsub-emulator package) or set PUBSUB_EMULATOR_HOST" >&2
	exit 1
fi

((${#pkgs[@]})) || exit 0

if [ "$(id -u)" -eq 0 ]; then
	apt=(apt-get)
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
	apt=(sudo apt-get)
else
	echo "missing test services; install them with: sudo apt-get install -y ${pkgs[*]}" >&2
	exit 1
fi
echo "installing ${pkgs[*]}"
export DEBIAN_FRONTEND=noninteractive
"${apt[@]}" update -qq
"${apt[@]}" install -y -qq "${pkgs[@]}" >/dev/null
# The packages may start a system instance; the tests do not use it.
