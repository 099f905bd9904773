#!/usr/bin/env bash
# checkov on the Terraform modules (and on any extra folders given, such as a rendered root module),
# from a virtualenv of its own: checkov pins an old boto3 that the project's .venv must not get.
#
#   infra/checkov.sh                    create .venv-checkov if missing, check infra/modules
#   infra/checkov.sh DIR...             the same, plus each DIR
#   infra/checkov.sh --install-only     only create the virtualenv
#
# Extra checkov arguments go in CHECKOV_ARGS (e.g. CHECKOV_ARGS="--output json"); CHECKOV_FLAGS replaces
# the default "--quiet --compact" (CHECKOV_FLAGS="" lists the passed and skipped checks too).
set -euo pipefail
dirs=()
for arg in "$@"; do
  [ "$arg" = "--install-only" ] || dirs+=("$(cd "$arg" && pwd)")  # before the cd below
done
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${CHECKOV_VENV:-.venv-checkov}
# pinned: a newer checkov brings new checks, which would turn a green tree red without a change of ours
CHECKOV_VERSION=${CHECKOV_VERSION:-3.3.30}
# uv (the project's .venv has it after `make install`) installs in parallel: 13 s against pip's 31 s here
UV=${UV:-.venv/bin/uv}
if [ ! -x "$VENV/bin/checkov" ]; then
  echo "checkov.sh: creating $VENV (checkov $CHECKOV_VERSION)" >&2
  "$PYTHON" -m venv "$VENV"
  if [ -x "$UV" ] && "$UV" pip install --python "$VENV/bin/python" --quiet --compile-bytecode \
       "checkov==$CHECKOV_VERSION"; then
    :
  else
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "checkov==$CHECKOV_VERSION"
  fi
fi
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
status=0
for dir in infra/modules ${dirs[@]+"${dirs[@]}"}; do
  # nothing is fetched: every module here is local (--download-external-modules false) and no
  # guideline or severity comes from the vendor's API (--skip-download)
  # shellcheck disable=SC2086
  "$VENV/bin/checkov" -d "$dir" ${CHECKOV_FLAGS---quiet --compact} --framework terraform --skip-download \
    --download-external-modules false ${CHECKOV_ARGS:-} || status=$?
done
exit $status
