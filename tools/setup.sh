#!/usr/bin/env bash
# Machine set-up for megamoe-ep. Idempotent, and quick when everything is already there.
#
# Installs, through the machine's package manager, what Bazel needs to build this repository:
#   - Bazel: Debian's bazel-bootstrap 4.2.3 (pulls a JDK). Whatever it would download at build
#     time is supplied from this repository instead (tools/bazel/OFFLINE.md);
#   - CPython 3.11 with venv: the base of the locked Python environment, which Bazel builds
#     itself from requirements.lock (tools/bazel/python_env.bzl) through pip's own configuration.
set -euo pipefail

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
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
  bazel_version="$(dpkg-query -W -f='${Version}' bazel-bootstrap)"
  if [[ "${bazel_version}" != 4.2.3* ]]; then
    echo "setup: this repository is set up for bazel-bootstrap 4.2.3, the package manager gave ${bazel_version}" >&2
    exit 1
  fi
fi

echo "setup: ok (bazel-bootstrap ${bazel_version}, $("${python}" --version 2>&1))" >&2
