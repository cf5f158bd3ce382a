"""Local stand-in for @rules_java//java:defs.bzl: the native Java rules, re-exported.

@bazel_tools//tools/jdk (whose toolchains Bazel 4.2.3 registers for every build) loads these
names from @rules_java, which Bazel would otherwise download. This project has no Java of its
own. See tools/bazel/OFFLINE.md.
"""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_lite_proto_library = native.java_lite_proto_library
java_plugin = native.java_plugin
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_test = native.java_test
java_toolchain = native.java_toolchain
