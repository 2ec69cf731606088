"""A stand-in for rules_java: Bazel 4.2's own tools load these names from
@rules_java, which Bazel would download; they are the native rules."""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
