#!/bin/sh
# Bazel's --workspace_status_command (.bazelrc): runs before every build and prints
#   STABLE_MOE_EP_SOURCE_DIGEST <sha1 of the source tree as it is now>
# (the content of every tracked file and of every untracked file git does not ignore, by path; without git, of every
# file but bazel-*, .git and .drop). //tools/bazel:source_digest copies that line into a file, and the tests whose
# input is the whole source tree (the nested-Bazel tests, the source scans) take that file as data: they rerun when
# any source changes and come from the cache when none did. It hashes file contents, never git's index: the
# index's stat data changes with `git status` or a touch that changes nothing, and a digest of it reran those
# tests for nothing. About 0.1 s for this tree.
cd "$(dirname "$0")/../.." || exit 1
if git rev-parse --git-dir >/dev/null 2>&1; then
  digest=$(git ls-files -z --cached --others --exclude-standard \
    | LC_ALL=C sort -zu | xargs -0 -r sha1sum 2>/dev/null | sha1sum | cut -c1-40)
else
  digest=$(find . \( -name .git -o -name .drop -o -name 'bazel-*' \) -prune -o -type f -print0 \
    | LC_ALL=C sort -z | xargs -0 -r sha1sum | sha1sum | cut -c1-40)
fi
echo "STABLE_MOE_EP_SOURCE_DIGEST ${digest}"
