#!/bin/sh
# Tools for the aarch64 kernel tests: a cross compiler to link the test driver, and qemu to run it.
set -e
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross
