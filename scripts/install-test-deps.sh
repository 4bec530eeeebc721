#!/usr/bin/env bash
# Installs the system packages the test suite needs, when they are missing (Debian/Ubuntu).
#
#   prometheus       real Prometheus server for tests/collectors/test_prometheus_server.py
#   chromium         headless browser for the web-UI tests
#   chromium-driver  its WebDriver
#   postgresql       real PostgreSQL server (initdb, pg_ctl) for the shared-state tests
#
# Idempotent: installs nothing when everything is present. Runs `apt-get update` once, and only
# when something is missing. As a non-root user it only lists what is missing and exits 0.
set -euo pipefail

PACKAGES=(prometheus chromium chromium-driver postgresql)

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-test-deps: all present (${PACKAGES[*]})"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "install-test-deps: missing ${missing[*]}; run as root to install:"
    echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: missing ${missing[*]} and apt-get is not available" >&2
    exit 1
fi

echo "install-test-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-test-deps: installed ${missing[*]}"
