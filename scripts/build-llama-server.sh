#!/usr/bin/env bash
# llama-server, built with draftlab's llama.cpp libraries in one build: scripts/build-llama-cpp.sh does it (and installs
# llama-cpp-python over the same build). Kept for the commands and docs that name this script; prints the binary.
#   PYTHON=.venv/bin/python scripts/build-llama-server.sh
set -euo pipefail
exec bash "$(dirname "$0")/build-llama-cpp.sh" "${PYTHON:-python3}"
