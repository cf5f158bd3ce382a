"""Local stand-in for @rules_cc//cc:defs.bzl: the native C++ rules, re-exported.

Bazel 4.2.3's own @bazel_tools BUILD files load these names from @rules_cc, which Bazel
would otherwise download from the network. This project has no C++ of its own; the stub only
has to make @bazel_tools load. See tools/bazel/OFFLINE.md.
"""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
objc_library = native.objc_library
