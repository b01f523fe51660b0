#!/usr/bin/env bash
# Regenerate ci/example_report.md: the gate's Markdown report of the reference backend's CPU run.
# Usage: bash ci/make_example_report.sh [OUT_DIR]   (full reports stay in OUT_DIR, default reports/example)
# The example is only replaced when the gate passes: a failing reference is a bug, not an example.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-reports/example}"
python ci/run_conformance.py --backend reference --tier cpu --expectations ci/expectations/reference.toml --out "$out"
cp "$out/report.md" ci/example_report.md
echo "wrote ci/example_report.md"
