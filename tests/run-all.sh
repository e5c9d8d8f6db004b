#!/usr/bin/env bash
# Runs every check and test gpu-flight has, on any machine with a Rust toolchain and Python 3:
# formatting, clippy (warnings are errors), the Rust unit and integration tests (host backend;
# GPU tests are ignored without a device), and the pyarrow suite against the real binary, with
# pyarrow bootstrapped into .venv from tests/python/requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (warnings are errors)"
cargo clippy --all-targets --locked -- -D warnings

step "cargo test"
cargo test --locked

step "pyarrow suite"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
# Spark (test_spark.py) runs on a Java runtime, and the JVM client (test_java_client.py) is built
# with a JDK, protoc and Debian's grpc-java and netty 4.1: Debian's packages, where they are missing
# and apt can add them.
if command -v apt-get >/dev/null 2>&1 && command -v dpkg-query >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  jvm_packages=""
  command -v javac >/dev/null 2>&1 || jvm_packages="openjdk-17-jdk-headless"
  for package in protobuf-compiler libprotobuf-dev protobuf-compiler-grpc-java-plugin libgrpc-java \
    libprotobuf-java libguava-java libperfmark-java libnetty-java libgeronimo-annotation-1.3-spec-java; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'ok installed' ||
      jvm_packages="$jvm_packages $package"
  done
  if [ -n "$jvm_packages" ]; then
    # shellcheck disable=SC2086 # the list is split on purpose
    apt-get install -y -q --no-install-recommends $jvm_packages >/dev/null ||
      { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $jvm_packages >/dev/null; } ||
      echo "could not install$jvm_packages: test_spark.py or test_java_client.py will be skipped" >&2
  fi
fi
# The Python package, editable, with Dask (tests/python/test_client.py and test_dask.py use it).
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e './python[dask]'

step "ruff and mypy (the Python package and its tests)"
package_tests="tests/python/test_client.py tests/python/test_dask.py tests/python/test_device_interface.py tests/python/test_ipc.py tests/python/test_shared_memory.py tests/python/test_ipc_import.py tests/python/test_export_lifetime.py tests/python/test_cluster.py tests/python/test_flight_sql.py tests/python/test_spark.py tests/python/test_java_client.py tests/python/test_module_graph.py"
# shellcheck disable=SC2086 # the list is split on purpose
.venv/bin/ruff check --config python/pyproject.toml python $package_tests
# shellcheck disable=SC2086
.venv/bin/ruff format --check --config python/pyproject.toml python $package_tests
.venv/bin/mypy --config-file python/pyproject.toml python/src
.venv/bin/mypy --config-file python/pyproject.toml tests/python/test_java_client.py
# `cargo test` built the binary already (a separate `cargo build` would rebuild dependencies
# without the dev-dependencies' features), in cargo's target directory: target/ unless
# CARGO_TARGET_DIR (or a cargo config) puts it elsewhere, which cargo itself reports.
target_dir="$(cargo metadata --format-version 1 --no-deps --locked |
  "$python" -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
binary="${GPU_FLIGHT_BIN:-$target_dir/debug/gpu-flight}"
test -x "$binary" || { echo "$binary is missing" >&2; exit 1; }
GPU_FLIGHT_BIN="$binary" .venv/bin/python -m pytest -q tests/python
