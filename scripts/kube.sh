#!/usr/bin/env bash
# A real, throwaway Kubernetes control plane with Kueue on this machine, for the Kubernetes tests
# (tests/kube_support.py) and for trying `chipledger kube watch|actuate` by hand: kube-apiserver v1.35.4 with etcd
# v3.6.5, kube-controller-manager, kube-scheduler, kwok v0.8.0 (a fake kubelet: Pods bound and Running, no
# containers) and the Kueue v0.17.0 manager with its webhooks, all on 127.0.0.1 ports 19701-19722. Everything is
# built from the Go module proxy (no images, no GitHub); the recipe, measured, is ../shared/kube/README.md.
#
#   bash scripts/kube.sh ensure   build the binaries into the cache when missing (about 11 min on 2 cores from bare,
#                                 0 s when cached), then start the cluster unless it already runs. Idempotent.
#                                 Always exits 0 (loud when something is missing): whether that is a skip or a
#                                 failure is the tests' decision (CHIPLEDGER_REQUIRE_KUBE=1).
#   bash scripts/kube.sh start    the same, but exits 1 when the cluster cannot be built or started
#   bash scripts/kube.sh stop     stop every process it started (by the pids in the state dir). Idempotent.
#   bash scripts/kube.sh status   which processes run (exit 1 if one is missing or the API server is not ready)
#   bash scripts/kube.sh build    only the build step
#
# After a start, `source $CHIPLEDGER_KUBE_DIR/env` gives KUBECONFIG (admin: system:masters), K8S_API, K8S_CA,
# K8S_TOKEN (admin), KUEUE_METRICS_URL, and the kubeconfigs of the two unprivileged users the tests bind to the
# ClusterRoles of deploy/kube/rbac.yaml: CHIPLEDGER_KUBE_WATCH_KUBECONFIG (user chipledger:kube-watch) and
# CHIPLEDGER_KUBE_ACTUATE_KUBECONFIG (user chipledger:kube-actuate).
#
# Environment:
#   CHIPLEDGER_KUBE_CACHE  binaries (bin/), Go module cache (gomod/) and build cache (gocache/); default
#                          ~/.cache/chipledger/kube, so that a fresh clone on a machine that built once pays nothing.
#                          bin/.stamp (versions + k8sbuild/go.sum hash) decides whether bin/ may be reused.
#   CHIPLEDGER_KUBE_DIR    run state (PKI, etcd data, logs, pids, kubeconfigs); default /tmp/chipledger-kube-$UID.
#                          A start from stopped wipes it: every start is an empty cluster.
#
# Why these settings: Kueue's webhooks and CRD conversion are registered by URL on 127.0.0.1 with our own CA
# (nothing routes a Service here: no kube-proxy, no DNS); Kueue then insists on a metrics certificate at the fixed
# path /etc/kueue/metrics/certs (root needed). kwok plays the kubelet of Nodes annotated kwok.x-k8s.io/node=fake,
# and Job pods complete only after the delay in their annotation pod-complete.stage.kwok.x-k8s.io/delay.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KDIR=$HERE/kube
CACHE=${CHIPLEDGER_KUBE_CACHE:-$HOME/.cache/chipledger/kube}
DIR=${CHIPLEDGER_KUBE_DIR:-/tmp/chipledger-kube-$(id -u)}
BIN=$CACHE/bin
K8S_VERSION=v1.35.4      # k8s.io/kubernetes; its staging modules are v0.35.4 (scripts/kube/k8sbuild/go.mod)
KUEUE_VERSION=v0.17.0    # sigs.k8s.io/kueue (k8s.io/* v0.35.3)
KWOK_VERSION=v0.8.0      # sigs.k8s.io/kwok
ETCD_PORT=19701 ETCD_PEER_PORT=19702 APISERVER_PORT=19710 KCM_PORT=19711 SCHED_PORT=19712 KWOK_PORT=19713
KUEUE_WEBHOOK_PORT=19720 KUEUE_HEALTH_PORT=19721 KUEUE_METRICS_PORT=19722
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok kueue)
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok kueue)
PYTHON=${PYTHON:-python3}

# shellcheck source=scripts/common.sh
. "$HERE/common.sh"  # loud

export PATH=/usr/local/go/bin:$PATH
export GOMODCACHE=$CACHE/gomod GOCACHE=$CACHE/gocache GOFLAGS=-buildvcs=false
KUEUE_SRC=$GOMODCACHE/sigs.k8s.io/kueue@$KUEUE_VERSION
KWOK_SRC=$GOMODCACHE/sigs.k8s.io/kwok@$KWOK_VERSION

stamp() { echo "$K8S_VERSION $KUEUE_VERSION $KWOK_VERSION $(sha256sum "$KDIR/k8sbuild/go.sum" | cut -c1-16)"; }

built() {
    local b
    for b in "${BINARIES[@]}"; do [[ -x $BIN/$b ]] || return 1; done
    [[ -f $BIN/.stamp && "$(cat "$BIN/.stamp")" == "$(stamp)" ]] || return 1
    [[ -d $KUEUE_SRC/config/components/crd/bases && -d $KWOK_SRC/kustomize/stage ]]
}

# build: every binary missing (all of them when the stamp changed), one go process at a time (each peaks at ~2 GiB).
# No -trimpath: the same flags on every build, else the build cache is useless (every package recompiled).
build() {
    built && return 0
    command -v go >/dev/null 2>&1 || { echo "kube.sh: Go (>= 1.25) is not installed (/usr/local/go/bin/go)" >&2; return 1; }
    mkdir -p "$BIN" "$CACHE"
    exec 9>"$CACHE/.build.lock"
    flock 9  # another build into this cache (a parallel ensure) finishes first; then its binaries are reused
    built && return 0
    local force=0 t0=$SECONDS minor ldf
    if [[ -f $BIN/.stamp && "$(cat "$BIN/.stamp")" != "$(stamp)" ]]; then
        echo "kube.sh: versions changed since the cached build: rebuilding" >&2; force=1
    fi
    minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
    ldf="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1
 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean
 -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
    ldf=${ldf//$'\n'/}  # the -X flags must stamp the version: clients gate features on it (Kueue's kubeversion)
    need() { [[ $force = 1 || ! -x $BIN/$1 ]]; }
    echo "kube.sh: building the control plane into $BIN (about 11 min from bare on 2 cores; once per machine)" >&2
    if need etcd || need kube-apiserver; then
        (cd "$KDIR/k8sbuild" && go build -ldflags="$ldf" -o "$BIN/" ./cmd/etcd k8s.io/kubernetes/cmd/kube-apiserver) || return 1
    fi
    if need kube-controller-manager; then
        (cd "$KDIR/k8sbuild" && go build -ldflags="$ldf" -o "$BIN/" k8s.io/kubernetes/cmd/kube-controller-manager) || return 1
    fi
    if need kube-scheduler; then
        (cd "$KDIR/k8sbuild" && go build -ldflags="$ldf" -o "$BIN/" k8s.io/kubernetes/cmd/kube-scheduler) || return 1
    fi
    if need kwok; then
        (cd /tmp && GOBIN="$BIN" go install -ldflags='-s -w' "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION") || return 1
    fi
    if need kueue; then
        (cd /tmp && GOBIN="$BIN" go install -ldflags='-s -w' "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION") || return 1
    fi
    # Kueue's CRDs and webhooks, and kwok's Stages, come from the same module zips
    [[ -d $KUEUE_SRC/config/components/crd/bases ]] || (cd /tmp && go mod download "sigs.k8s.io/kueue@$KUEUE_VERSION") || return 1
    [[ -d $KWOK_SRC/kustomize/stage ]] || (cd /tmp && go mod download "sigs.k8s.io/kwok@$KWOK_VERSION") || return 1
    stamp >"$BIN/.stamp"
    echo "kube.sh: built in $((SECONDS - t0))s" >&2
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

api_ready() {
    [[ -f $DIR/env ]] || return 1
    curl -fsS --max-time 2 --cacert "$DIR/pki/ca.crt" --cert "$DIR/pki/admin.crt" --key "$DIR/pki/admin.key" \
        "https://127.0.0.1:$APISERVER_PORT/readyz" >/dev/null 2>&1
}

running() {
    local c
    for c in "${COMPONENTS[@]}"; do pid_alive "$DIR/pids/$c.pid" || return 1; done
    api_ready && curl -fsS --max-time 2 "http://127.0.0.1:$KUEUE_HEALTH_PORT/readyz" >/dev/null 2>&1
}

launch() {  # name cmd...: in its own session, output to logs/name.log, pid to pids/name.pid
    local name=$1; shift
    setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$DIR/pids/$name.pid"
}

wait_url() {  # url what seconds [curl options...]
    local url=$1 what=$2 deadline=$((SECONDS + $3)); shift 3
    while (( SECONDS < deadline )); do
        curl -fsS --max-time 2 "$@" "$url" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    echo "kube.sh: $what did not become ready ($url); its log: $DIR/logs" >&2
    tail -n 20 "$DIR"/logs/*.log >&2
    return 1
}

pki() {
    local p=$DIR/pki
    mkdir -p "$p/kueue-webhook-certs"
    (
        cd "$p" || exit 1
        openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj /CN=chipledger-kube-ca 2>/dev/null
        cert() {  # name subject extensions
            openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
            printf '%b' "$3" >"$1.ext"
            openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -out "$1.crt" \
                -extfile "$1.ext" 2>/dev/null
        }
        local srv='basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost'
        local cli='basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n'
        cert apiserver /CN=kube-apiserver "$srv,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.0.0.1"
        cert kueue-webhook /CN=kueue-webhook "$srv"
        cert admin "/O=system:masters/CN=admin" "$cli"
        openssl genrsa -out sa.key 2048 2>/dev/null
        openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
        cp kueue-webhook.crt kueue-webhook-certs/tls.crt && cp kueue-webhook.key kueue-webhook-certs/tls.key
    ) || return 1
    # Kueue with internalCertManagement off insists on a metrics certificate at this fixed path
    mkdir -p /etc/kueue/metrics/certs || return 1
    cp "$p/kueue-webhook.crt" /etc/kueue/metrics/certs/tls.crt && cp "$p/kueue-webhook.key" /etc/kueue/metrics/certs/tls.key
    # static bearer tokens: the admin (curl, Kueue's metrics), and the two unprivileged users of the adapters
    # (no group: they may do only what deploy/kube/rbac.yaml's ClusterRoles bound to them allow)
    ADMIN_TOKEN=$(openssl rand -hex 16) WATCH_TOKEN=$(openssl rand -hex 16) ACTUATE_TOKEN=$(openssl rand -hex 16)
    {
        echo "$ADMIN_TOKEN,admin-token,admin-token-uid,system:masters"
        echo "$WATCH_TOKEN,chipledger:kube-watch,chipledger-kube-watch-uid"
        echo "$ACTUATE_TOKEN,chipledger:kube-actuate,chipledger-kube-actuate-uid"
    } >"$p/tokens.csv"
}

kubeconfig() {  # file user-yaml
    cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: chipledger-test
  cluster: {server: "https://127.0.0.1:$APISERVER_PORT", certificate-authority: "$DIR/pki/ca.crt"}
users:
- name: u
  user: $2
contexts:
- name: chipledger-test
  context: {cluster: chipledger-test, user: u}
current-context: chipledger-test
EOF
}

up() {
    local t0=$SECONDS
    for b in "${BINARIES[@]}"; do [[ -x $BIN/$b ]] || { echo "kube.sh: $BIN/$b missing: the build failed" >&2; return 1; }; done
    command -v openssl >/dev/null && command -v curl >/dev/null || { echo "kube.sh: needs openssl and curl" >&2; return 1; }
    "$PYTHON" -c 'import yaml' 2>/dev/null || { echo "kube.sh: $PYTHON lacks PyYAML (PYTHON=.venv/bin/python)" >&2; return 1; }
    stop quiet
    rm -rf "$DIR"
    mkdir -p "$DIR"/{pki,pids,logs,etcd}
    pki || { echo "kube.sh: PKI failed (openssl; /etc/kueue needs root)" >&2; return 1; }
    local pk=$DIR/pki admin=$DIR/admin.kubeconfig
    kubeconfig "$admin" "{client-certificate: \"$pk/admin.crt\", client-key: \"$pk/admin.key\"}"
    kubeconfig "$DIR/watch.kubeconfig" "{token: \"$WATCH_TOKEN\"}"
    kubeconfig "$DIR/actuate.kubeconfig" "{token: \"$ACTUATE_TOKEN\"}"

    launch etcd "$BIN/etcd" --name default --data-dir "$DIR/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "default=http://127.0.0.1:$ETCD_PEER_PORT" \
        --unsafe-no-fsync --quota-backend-bytes=2147483648 --log-level=warn
    wait_url "http://127.0.0.1:$ETCD_PORT/health" etcd 60 || return 1
    # --endpoint-reconciler-type=none: an Endpoints object may not hold a loopback address. --watch-cache=false:
    # watches are served by etcd itself, so a watch from a compacted version gets a real `410 Gone` (the tests force
    # one; with the cache, the API server replays from its own window instead)
    launch kube-apiserver "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
        --bind-address=127.0.0.1 --secure-port="$APISERVER_PORT" --advertise-address=127.0.0.1 \
        --tls-cert-file="$pk/apiserver.crt" --tls-private-key-file="$pk/apiserver.key" \
        --client-ca-file="$pk/ca.crt" --token-auth-file="$pk/tokens.csv" \
        --service-account-issuer=https://kubernetes.default.svc \
        --service-account-key-file="$pk/sa.pub" --service-account-signing-key-file="$pk/sa.key" \
        --service-cluster-ip-range=10.0.0.0/24 --authorization-mode=RBAC --endpoint-reconciler-type=none \
        --cert-dir="$DIR/apiserver-certs" --profiling=false --v=1 --watch-cache=false
    local admin_curl=(--cacert "$pk/ca.crt" --cert "$pk/admin.crt" --key "$pk/admin.key")
    wait_url "https://127.0.0.1:$APISERVER_PORT/readyz" kube-apiserver 180 "${admin_curl[@]}" || return 1
    # kcm: the Job controller creates Pods for admitted Jobs; the node-lifecycle controller lifts kwok nodes' taint
    launch kube-controller-manager "$BIN/kube-controller-manager" \
        --kubeconfig="$admin" --authentication-kubeconfig="$admin" --authorization-kubeconfig="$admin" \
        --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --leader-elect=false --controllers='*' \
        --service-account-private-key-file="$pk/sa.key" --root-ca-file="$pk/ca.crt" \
        --use-service-account-credentials=false --profiling=false --v=1
    launch kube-scheduler "$BIN/kube-scheduler" \
        --kubeconfig="$admin" --authentication-kubeconfig="$admin" --authorization-kubeconfig="$admin" \
        --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false --profiling=false --v=1
    "$PYTHON" "$KDIR/kwok_stages.py" "$KWOK_SRC" "$DIR/kwok-stages.yaml" >/dev/null || return 1
    launch kwok "$BIN/kwok" --kubeconfig="$admin" --config="$DIR/kwok-stages.yaml" \
        --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
        --node-ip=127.0.0.1 --node-port="$KWOK_PORT" --server-address="127.0.0.1:$KWOK_PORT" \
        --cidr=127.1.0.0/24 --node-lease-duration-seconds=40

    # Kueue's CRDs by server-side apply (the workloads CRD is ~1 MB: too big for a client-side apply)
    "$PYTHON" "$KDIR/kueue_manifests.py" "$KUEUE_SRC" "$pk/ca.crt" "$KUEUE_WEBHOOK_PORT" "$DIR/kueue-manifests" >/dev/null || return 1
    api() { curl -fsS -A chipledger-kube-sh "${admin_curl[@]}" "$@"; }
    ssa() { api -X PATCH -H 'Content-Type: application/apply-patch+yaml' --data-binary @"$2" \
                "https://127.0.0.1:$APISERVER_PORT$1?fieldManager=chipledger-kube-sh&force=true" >/dev/null; }
    local path file
    while read -r path file; do ssa "$path" "$file" || return 1; done < <(grep customresourcedefinitions "$DIR/kueue-manifests/apply-list.txt")
    local deadline=$((SECONDS + 120))
    while read -r path file; do
        until api "https://127.0.0.1:$APISERVER_PORT$path" | grep -q '"type":"Established","status":"True"'; do
            (( SECONDS < deadline )) || { echo "kube.sh: CRD $path not established" >&2; return 1; }
            sleep 0.2
        done
    done < <(grep customresourcedefinitions "$DIR/kueue-manifests/apply-list.txt")
    api -X POST -H 'Content-Type: application/json' -d '{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"kueue-system"}}' \
        "https://127.0.0.1:$APISERVER_PORT/api/v1/namespaces" >/dev/null || return 1
    cat >"$DIR/kueue-config.yaml" <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
health:
  healthProbeBindAddress: 127.0.0.1:$KUEUE_HEALTH_PORT
metrics:
  bindAddress: 127.0.0.1:$KUEUE_METRICS_PORT
webhook:
  host: 127.0.0.1
  port: $KUEUE_WEBHOOK_PORT
  certDir: $pk/kueue-webhook-certs
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
integrations:
  frameworks: ["batch/job", "pod"]
EOF
    launch kueue env KUBECONFIG="$admin" "$BIN/kueue" --config="$DIR/kueue-config.yaml" \
        --feature-gates=VisibilityOnDemand=false --zap-log-level=info
    wait_url "https://127.0.0.1:$KCM_PORT/healthz" kube-controller-manager 120 -k || return 1
    wait_url "https://127.0.0.1:$SCHED_PORT/healthz" kube-scheduler 120 -k || return 1
    wait_url "http://127.0.0.1:$KWOK_PORT/healthz" kwok 60 || return 1
    wait_url "http://127.0.0.1:$KUEUE_HEALTH_PORT/readyz" kueue 180 || return 1
    while read -r path file; do ssa "$path" "$file" || return 1; done < <(grep webhookconfigurations "$DIR/kueue-manifests/apply-list.txt")
    cat >"$DIR/env" <<EOF
export KUBECONFIG=$admin
export K8S_API=https://127.0.0.1:$APISERVER_PORT
export K8S_CA=$pk/ca.crt
export K8S_TOKEN=$ADMIN_TOKEN
export KUEUE_METRICS_URL=https://127.0.0.1:$KUEUE_METRICS_PORT/metrics
export CHIPLEDGER_KUBE_WATCH_KUBECONFIG=$DIR/watch.kubeconfig
export CHIPLEDGER_KUBE_ACTUATE_KUBECONFIG=$DIR/actuate.kubeconfig
EOF
    echo "kube.sh: control plane and Kueue up in $((SECONDS - t0))s ($DIR)" >&2
}

start() {  # $1: strict (exit status says whether the cluster runs)
    if running; then
        echo "kube.sh: already running ($DIR)" >&2
    else
        if ! build; then
            loud "THE KUBERNETES CONTROL PLANE COULD NOT BE BUILT (see above; Go >= 1.25 and the Go module proxy are" \
                 "needed). The Kubernetes tests will be skipped (or fail with CHIPLEDGER_REQUIRE_KUBE=1)."
            return 1
        fi
        if ! up; then
            stop quiet
            loud "THE KUBERNETES CONTROL PLANE DID NOT START (see above; logs in $DIR/logs)." \
                 "The Kubernetes tests will be skipped (or fail with CHIPLEDGER_REQUIRE_KUBE=1)."
            return 1
        fi
    fi
    echo "source $DIR/env"
}

stop() {  # newest first; only a pid still running one of our binaries (a reused pid is left alone)
    local quiet=${1:-} name f pid n
    for ((n = ${#COMPONENTS[@]} - 1; n >= 0; n--)); do
        name=${COMPONENTS[n]}
        f=$DIR/pids/$name.pid
        [[ -f $f ]] || continue
        pid=$(cat "$f")
        if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$BIN/"; then
            kill -TERM "$pid" 2>/dev/null
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
        fi
        rm -f "$f"
    done
    [[ -z $quiet ]] && echo "kube.sh: stopped ($DIR)" >&2
    return 0
}

status() {
    local ok=0 c
    for c in "${COMPONENTS[@]}"; do
        if pid_alive "$DIR/pids/$c.pid"; then echo "$c running (pid $(cat "$DIR/pids/$c.pid"))"
        else echo "$c not running"; ok=1; fi
    done
    api_ready && echo "kube-apiserver ready" || { echo "kube-apiserver not ready"; ok=1; }
    return $ok
}

case "${1:-}" in
    ensure) start; exit 0 ;;
    start) start; exit $? ;;
    stop) stop; exit 0 ;;
    status) status; exit $? ;;
    build) build; exit $? ;;
    *) echo "usage: $0 ensure|start|stop|status|build" >&2; exit 2 ;;
esac
