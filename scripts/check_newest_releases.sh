#!/usr/bin/env bash
# Does the suite still hold on the newest releases of the libraries its CLI, tasks and data are
# built on? Installs the newest lightning, torchmetrics, jsonargparse and litdata into a throwaway
# virtual environment over this Python's packages (torch and the rest stay as installed), then
# runs the contract tests there. Passing here is what lets pyproject.toml's upper bounds move.
#
#   scripts/check_newest_releases.sh                  # tests/test_contract.py tests/test_compat.py -m "not slow"
#   scripts/check_newest_releases.sh tests/test_compat.py      # other pytest arguments
#
# lightning 2.6.2 and 2.6.3 were compromised releases: never installed.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=$(mktemp -d "${TMPDIR:-/tmp}/newest-releases.XXXXXX")
trap 'rm -rf "$venv"' EXIT
python -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade \
    "lightning!=2.6.2,!=2.6.3" torchmetrics "jsonargparse[signatures,omegaconf]" litdata

echo "newest releases (constraints.txt pins what CI tests):"
for package in lightning torchmetrics jsonargparse litdata; do
    newest=$("$venv/bin/python" -c "from importlib.metadata import version; print(version('$package'))")
    pinned=$(grep -i "^$package==" constraints.txt | cut -d= -f3 || true)
    echo "  $package $newest (pinned ${pinned:-none})"
done

export WANDB_MODE=offline NO_ALBUMENTATIONS_UPDATE=1
if [ $# -eq 0 ]; then
    set -- tests/test_contract.py tests/test_compat.py -m "not slow"
fi
"$venv/bin/python" -m pytest -q "$@"
