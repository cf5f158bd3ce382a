#!/usr/bin/env bash
# Machine set-up for megamoe-ep. Idempotent, and quick when everything is already there.
#
# Installs, through the machine's package manager, what Bazel needs to build this repository:
#   - Bazel: Debian's bazel-bootstrap 4.2.3 (pulls a JDK). Whatever it would download at build
#     time is supplied from this repository instead (tools/bazel/OFFLINE.md);
#   - CPython 3.11 with venv: the base of the locked Python environment, which Bazel builds
#     itself from requirements.lock (tools/bazel/python_env.bzl) through pip's own configuration.
#
# If another apt-get / dpkg holds the package manager's lock (unattended upgrades on a fresh
# machine, a second setup), it waits for it, up to MOE_EP_APT_WAIT_S seconds (default 300), then
# stops with a message that says what to do instead of apt's raw "Could not get lock".
set -euo pipefail

apt_wait_s="${MOE_EP_APT_WAIT_S:-300}"
apt_poll_s="${MOE_EP_APT_POLL_S:-5}"

# apt-get "$@" (as root), retried while another process holds apt's or dpkg's lock.
apt_get() {
  local start=${SECONDS} out rc holder said=-1
  while true; do
    rc=0
    out="$("${sudo[@]}" apt-get "$@" 2>&1)" || rc=$?
    if ((rc == 0)); then
      grep -E '^(W|E):' <<<"${out}" >&2 || true
      return 0
    fi
    if ! grep -qiE 'could not get lock|unable to acquire the dpkg frontend lock|unable to lock' <<<"${out}"; then
      printf '%s\n' "${out}" >&2
      return "${rc}"
    fi
    holder="$(grep -oiE 'held by process [0-9]+( \([^)]*\))?' <<<"${out}" | head -n 1 || true)"
    holder="lock ${holder:-held by another apt-get or dpkg}"
    if ((SECONDS - start >= apt_wait_s)); then
      echo "setup: the package manager is still busy after ${apt_wait_s}s (${holder})." >&2
      echo "setup: another apt-get/dpkg is running (e.g. unattended upgrades). Let it finish" >&2
      echo "setup: (ps -ef | grep -E 'apt|dpkg'), then run tools/setup.sh again;" >&2
      echo "setup: MOE_EP_APT_WAIT_S=<seconds> waits longer. Nothing was installed." >&2
      return 1
    fi
    if ((said < 0 || SECONDS - said >= 30)); then
      echo "setup: the package manager is busy (${holder}); waiting for it, up to ${apt_wait_s}s" >&2
      said=${SECONDS}
    fi
    sleep "${apt_poll_s}"
  done
}

missing=()

bazel_version="$(dpkg-query -W -f='${Version}' bazel-bootstrap 2>/dev/null || true)"
if [[ "${bazel_version}" != 4.2.3* ]] || ! command -v bazel >/dev/null 2>&1; then
  missing+=(bazel-bootstrap)
fi

python="${MOE_EP_PYTHON:-python3.11}"
if ! command -v "${python}" >/dev/null 2>&1 \
    || ! "${python}" -c 'import ensurepip, venv, sys; assert sys.version_info[:2] == (3, 11)' >/dev/null 2>&1; then
  missing+=(python3.11 python3.11-venv)
fi

if ((${#missing[@]})); then
  sudo=()
  if [[ "$(id -u)" -ne 0 ]]; then sudo=(sudo); fi
  echo "setup: installing ${missing[*]}" >&2
  apt_get update -qq
  DEBIAN_FRONTEND=noninteractive apt_get install -y -qq "${missing[@]}" >/dev/null
  bazel_version="$(dpkg-query -W -f='${Version}' bazel-bootstrap)"
  if [[ "${bazel_version}" != 4.2.3* ]]; then
    echo "setup: this repository is set up for bazel-bootstrap 4.2.3, the package manager gave ${bazel_version}" >&2
    exit 1
  fi
fi

echo "setup: ok (bazel-bootstrap ${bazel_version}, $("${python}" --version 2>&1))" >&2
