"""The symbols of @rules_java//java:defs.bzl that @bazel_tools//tools/jdk loads."""

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
