#!/bin/sh
# Tools for the aarch64 kernel tests: a cross compiler to link the test driver, and qemu to run it.
set -e
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross
# an arm64 Python for the end-to-end test (tests/qemu/test_aarch64_e2e.py), cached in .cache/aarch64
sh "$(dirname "$0")/setup_python.sh"
