"""The knob tuner: python -m tools.tune (bazel run //tools:tune). See tools/tune/tune.py."""
