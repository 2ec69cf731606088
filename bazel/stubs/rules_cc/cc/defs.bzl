"""A stand-in for rules_cc: Bazel 4.2's own tools load these names from
@rules_cc, which Bazel would download; they are the native rules."""

cc_binary = native.cc_binary
cc_library = native.cc_library
cc_test = native.cc_test
cc_proto_library = native.cc_proto_library
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
objc_library = native.objc_library
