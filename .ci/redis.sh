# Source this (bash): starts the Redis servers the KV-tier tests use, on loopback only, and exports
#   TOKENFORGE_TEST_REDIS_URL          one standalone instance
#   TOKENFORGE_TEST_REDIS_CLUSTER_URL  a 3-master Redis Cluster
# Installs redis-server from the Debian packages when it is missing. Idempotent: servers already
# answering on these ports are reused.
tf_redis_main() {
    local base="${TOKENFORGE_REDIS_PORT_BASE:-16390}" dir="${TMPDIR:-/tmp}/tokenforge-ci-redis"
    if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    fi
    local opts=(--bind 127.0.0.1 --protected-mode yes --save "" --appendonly no --daemonize yes
                --maxmemory 1gb --maxmemory-policy volatile-lru)
    mkdir -p "$dir"
    local port
    for port in "$base" $((base + 1)) $((base + 2)) $((base + 3)); do
        redis-cli -p "$port" ping >/dev/null 2>&1 && continue
        mkdir -p "$dir/$port"
        if [ "$port" = "$base" ]; then
            redis-server "${opts[@]}" --port "$port" --dir "$dir/$port" --logfile "$dir/$port/log"
        else
            redis-server "${opts[@]}" --port "$port" --dir "$dir/$port" --logfile "$dir/$port/log" \
                --cluster-enabled yes --cluster-config-file "$dir/$port/nodes.conf" --cluster-node-timeout 2000
        fi
    done
    for port in "$base" $((base + 1)) $((base + 2)) $((base + 3)); do
        local i
        for i in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
    done
    if ! redis-cli -p $((base + 1)) cluster info 2>/dev/null | grep -q "cluster_state:ok"; then
        redis-cli --cluster create 127.0.0.1:$((base + 1)) 127.0.0.1:$((base + 2)) 127.0.0.1:$((base + 3)) \
            --cluster-replicas 0 --cluster-yes >/dev/null
        local i
        for i in $(seq 100); do
            redis-cli -p $((base + 1)) cluster info | grep -q "cluster_state:ok" && break
            sleep 0.1
        done
    fi
    export TOKENFORGE_TEST_REDIS_URL="redis://127.0.0.1:$base/0"
    export TOKENFORGE_TEST_REDIS_CLUSTER_URL="redis+cluster://127.0.0.1:$((base + 1)),127.0.0.1:$((base + 2)),127.0.0.1:$((base + 3))"
}
tf_redis_main
