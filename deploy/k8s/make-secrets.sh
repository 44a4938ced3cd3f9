#!/bin/sh
# Writes deploy/k8s/base/secrets.env, the source of the tandem-secrets Secret, with fresh
# random values. Nothing secret is committed: without this file `kubectl kustomize` stops.
#   deploy/k8s/make-secrets.sh                       # Redis in the cluster (redis.yaml)
#   deploy/k8s/make-secrets.sh --redis-url URL       # an external Redis, URL with its password
# Refuses to overwrite an existing file (rotating keys is a decision, not a side effect).
set -eu
out="$(dirname "$0")/base/secrets.env"
if [ -e "$out" ]; then
  echo "$out exists; delete it first to make new secrets" >&2
  exit 1
fi
rand() { od -An -N32 -tx1 /dev/urandom | tr -d ' \n'; }
redis_password="$(rand)"
redis_url="redis://:${redis_password}@redis:6379/0"
if [ "${1:-}" = "--redis-url" ]; then
  redis_url="${2:?--redis-url needs a URL}"
fi
umask 077
cat > "$out" <<EOT
TANDEM_SERVICE_API_KEY=$(rand)
TANDEM_REDIS_URL=${redis_url}
REDIS_PASSWORD=${redis_password}
EOT
echo "wrote $out"
