"""The one rank launcher: N local processes, torchrun-style env, for Bazel tests and plain pytest alike."""
