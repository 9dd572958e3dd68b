#!/usr/bin/env bash
# Rebuild the Cython extensions in place. Serialised with flock so that parallel builds from
# several shells in one checkout do not trample each other's build/ directory.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/trainloom-build.lock python setup.py build_ext --inplace -j 2 "$@"
