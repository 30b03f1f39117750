#!/usr/bin/env bash
# Debian packages the test suite needs, installed by the project itself (never `playwright install`,
# which downloads a browser): chromium, driven by Playwright for the real-browser widget tests, and
# iproute2 (`ip`, `tc`) for the two-"node" network-namespace runs of Lab 06 and the capstone, and
# bubblewrap (`bwrap`), the sandbox `python -m course_lib grade` runs each submission's kernel in, and
# slurm-wlm + munge (slurmctld, slurmd, sbatch, munged), the private Slurm that tests/test_slurm.py runs the
# capstone's batch scripts on (its own key, ports and folders: the system's /etc/slurm and /etc/munge unused).
# A fast no-op when both are present. Needs root (or sudo) and apt-get.
set -euo pipefail

missing=()
[[ -x /usr/bin/chromium ]] || missing+=(chromium fonts-liberation)
command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 || missing+=(iproute2)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || missing+=(slurm-wlm munge)
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "system-deps: chromium present ($(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)), iproute2 present, bubblewrap present, slurm-wlm and munge present"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    # Not Debian/Ubuntu: nothing we can install; the browser tests skip without /usr/bin/chromium.
    echo "system-deps: no apt-get here; install ${missing[*]} yourself" \
         "(browser and two-node tests are skipped without them)" >&2
    exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "system-deps: ${missing[*]} missing and installing needs root: run as root, or" \
             "apt-get install ${missing[*]}" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "system-deps: installing ${missing[*]} with apt-get (waiting up to ${APT_LOCK_TIMEOUT:-600} s for another apt to finish)"
# --no-install-recommends: chromium's recommends are a desktop (printing, avahi, notification daemon, perl
# web libraries: 115 packages against 20, ~30 s of dpkg against 9 s); headless Chromium needs none of them.
log=$(mktemp)   # apt's progress is hundreds of lines: keep it out of the test log unless it fails
# Another apt (unattended-upgrades, a second `make test`) may hold the dpkg and list locks: wait for it (apt's own
# DPkg::Lock::Timeout, in seconds, covers both) instead of failing at once with "Could not get lock".
lock_wait=(-o "DPkg::Lock::Timeout=${APT_LOCK_TIMEOUT:-600}")
if ! { $SUDO apt-get update -q "${lock_wait[@]}" \
        && $SUDO apt-get install -y -q --no-install-recommends "${lock_wait[@]}" "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    exit 1
fi
rm -f "$log"
[[ -x /usr/bin/chromium ]] && /usr/bin/chromium --version || true
