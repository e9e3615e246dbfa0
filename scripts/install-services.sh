#!/usr/bin/env bash
# Installs the servers the backend tests run against, when they are missing.
# Tests start their own instances on free loopback ports; nothing is started
# here. Needs root (or sudo) for apt-get; otherwise says what to install.
set -euo pipefail

pkgs=()
command -v redis-server >/dev/null 2>&1 || pkgs+=(redis-server)

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
