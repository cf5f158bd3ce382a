"""`python -m tools.drop ...` from the repo root (Bazel runs tools/drop/cli.py)."""

import sys

from tools.drop.cli import main

sys.exit(main())
