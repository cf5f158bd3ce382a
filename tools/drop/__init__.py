"""Kernel-drop tooling: bump, audit, generated symbol tables, layering check."""
