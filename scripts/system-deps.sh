#!/usr/bin/env bash
# Debian packages the test suite needs, installed by the project itself (never `playwright install`,
# which downloads a browser): chromium, driven by Playwright for the real-browser widget tests.
# A fast no-op when /usr/bin/chromium exists. Needs root (or sudo) and apt-get.
set -euo pipefail

if [[ -x /usr/bin/chromium ]]; then
    echo "system-deps: chromium present ($(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium))"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    # Not Debian/Ubuntu: nothing we can install; the browser tests skip without /usr/bin/chromium.
    echo "system-deps: no apt-get here; install chromium at /usr/bin/chromium yourself" \
         "(browser tests are skipped without it)" >&2
    exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "system-deps: chromium is missing and installing it needs root: run as root, or" \
             "apt-get install chromium" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "system-deps: installing chromium with apt-get"
$SUDO apt-get update -q
$SUDO apt-get install -y -q chromium fonts-liberation
/usr/bin/chromium --version
