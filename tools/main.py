"""The main job: `bazel run //tools:main`.

PLACEHOLDER, to be replaced by the runtime owner (moe_ep/): it only proves that the locked
environment runs. The real job imports moe_ep and runs an EP MoE layer end to end.
"""

import sys


def main() -> int:
    import torch  # from the locked environment (requirements.lock), not the machine's python3

    try:
        import moe_ep  # noqa: F401  (reachable once tools/BUILD lists //moe_ep in deps)
        have_moe_ep = True
    except ImportError:
        have_moe_ep = False
    print(f"megamoe-ep main (placeholder): python {sys.version.split()[0]} at {sys.executable}, "
          f"torch {torch.__version__}, moe_ep importable: {have_moe_ep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
