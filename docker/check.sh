#!/usr/bin/env bash
# Build aiak's container image from docker/Dockerfile and run it for real, on a CPU machine with no registry.
#
#   sudo bash docker/check.sh [--save FILE] [--keep]
#
# 1. engine    podman, runc and mmdebstrap from Debian's packages, installed when missing; runc with lower default
#              limits (crun cannot raise RLIMIT_NOFILE in this kind of sandbox) through a containers.conf of its own
# 2. base      a local CPU stand-in for NGC's PyTorch image (docker/cpu-base.Dockerfile: Debian from mmdebstrap,
#              torch in a venv), kept between runs under a tag that names what it was built from
# 3. build     docker/Dockerfile with BASE_IMAGE set to that base (its own smoke check, `aiak doctor`, included)
# 4. run       `aiak --version`; the default command under a default run (small /dev/shm): it must start, exit 0
#              and say how to start the container properly; `aiak doctor` there must still exit non-zero; `aiak
#              doctor` with --shm-size; a short `aiak demo`; a test subset against the installed package
# 5. torchrun  two containers joined by a network of the engine's run examples/multinode.sh as docker/README.md
#              tells users to (one node each, gloo on the CPU); both ranks must exit 0 with identical weights
#
# It prints each step's time and the image's size. --save FILE writes the image as an OCI archive (`podman load
# -i FILE` or `docker load -i FILE`); --keep keeps it as localhost/aiak:cpu. Everything it started (containers,
# the network, the image unless kept, scratch files) is removed on every path: success, failure or Ctrl-C.
#
# Settings (environment): AIAK_CHECK_SUITE (Debian release of the base, bookworm), AIAK_CHECK_TORCH (the
# base's torch, torch==2.13.0+cpu), AIAK_CHECK_TIMEOUT (seconds any one step may take, 900).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "docker/check.sh: $*" >&2; exit 2; }

save="" keep=0
while [ $# -gt 0 ]; do
    case "$1" in
        --save) [ $# -ge 2 ] || die "--save needs a file name"; save="$(realpath -m "$2")"; shift 2 ;;
        --keep) keep=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (valid: --save FILE, --keep, --help)" ;;
    esac
done

suite="${AIAK_CHECK_SUITE:-bookworm}"
torch_spec="${AIAK_CHECK_TORCH:-torch==2.13.0+cpu}"
limit="${AIAK_CHECK_TIMEOUT:-900}"
run_id="aiak-check-$$"
image="localhost/$run_id:latest"
network="$run_id"
scratch="$(mktemp -d /var/tmp/aiak-check.XXXXXX)"
timings=()

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    [ "$status" = 0 ] || [ -z "$current" ] || echo "docker/check.sh: failed at step '$current' (exit $status)" >&2
    if command -v podman >/dev/null; then
        podman ps -aq --filter "label=$run_id" | xargs -r podman rm -f -t 0 >/dev/null 2>&1 || true
        podman network rm -f "$network" >/dev/null 2>&1 || true
        if [ "$keep" = 1 ] && podman image exists "$image" 2>/dev/null; then
            podman tag "$image" localhost/aiak:cpu && echo "kept the image as localhost/aiak:cpu"
        fi
        podman rmi -f "$image" >/dev/null 2>&1 || true
    fi
    rm -rf "$scratch"
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# STEP NAME COMMAND...: run it and record its time. A failure ends the script (set -e), and cleanup names the step.
current=""
step() {
    local name="$1" start
    shift
    echo "== $name"
    current="$name" start="$EPOCHREALTIME"
    "$@"
    timings+=("$(awk -v n="$name" -v s="$start" -v e="$EPOCHREALTIME" 'BEGIN { printf "%-52s %7.1f s", n, e - s }')")
    current=""
}
# Every wait is bounded: a command that runs past $limit seconds is stopped and fails its step.
bounded() { timeout --foreground --kill-after=10 "$limit" "$@"; }  # --foreground: Ctrl-C still reaches it

# -- 1. engine ---------------------------------------------------------------------------------------------------
install_engine() {
    local missing=()
    command -v podman >/dev/null || missing+=(podman)
    command -v runc >/dev/null || missing+=(runc)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    [ ${#missing[@]} = 0 ] && { echo "podman, runc and mmdebstrap are installed"; return; }
    [ "$(id -u)" = 0 ] || die "installing ${missing[*]} needs root (run with sudo)"
    command -v apt-get >/dev/null || die "install ${missing[*]}: this script knows only Debian's apt-get"
    echo "installing ${missing[*]} from Debian's packages"
    export DEBIAN_FRONTEND=noninteractive
    bounded apt-get install -y -q "${missing[@]}" >"$scratch/apt.log" 2>&1 \
        || { bounded apt-get update -q >>"$scratch/apt.log" 2>&1 \
             && bounded apt-get install -y -q "${missing[@]}" >>"$scratch/apt.log" 2>&1; } \
        || { tail -n 20 "$scratch/apt.log" >&2; die "apt-get install ${missing[*]} failed"; }
}
[ "$(id -u)" = 0 ] || die "run as root (sudo): rootful podman is what builds and runs images here"
step "install podman, runc, mmdebstrap (if missing)" install_engine

# Lower than the engine's own defaults, which this kind of sandbox refuses to set. A run that passes any --ulimit
# replaces the whole list, so those runs pass these two as well (engine_limits).
engine_limits=(--ulimit nofile=20000:20000 --ulimit nproc=4096:4096)
cat >"$scratch/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]

[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$scratch/containers.conf"

# pip inside the builds and containers uses this machine's package sources: its CA bundle (a TLS-intercepting
# proxy signs PyPI here), its wheel folders and file:// indexes, mounted read-only at the same paths. Where the
# base's torch is not in a local folder, PyTorch's CPU index is added (PyPI has only CUDA builds of torch).
pip_sources() {
    local conf="$scratch/pip.conf" mounts=() find_links=() indexes=() cert="" key value item
    while IFS='=' read -r key value; do
        value="${value#\'}"; value="${value%\'}"
        case "$key" in
            *find-links) for item in $value; do find_links+=("$item"); done ;;
            *extra-index-url|*index-url) for item in $value; do indexes+=("$item"); done ;;
            *.cert) cert="$value" ;;
        esac
    done < <(python3 -m pip config list 2>/dev/null)   # files and PIP_* variables alike
    [ -n "$cert" ] || cert=/etc/ssl/certs/ca-certificates.crt
    [ -f "$cert" ] && mounts+=(-v "$cert:/etc/ssl/certs/ca-certificates.crt:ro")
    local local_links=() local_indexes=() torch_here=0 path
    for item in "${find_links[@]}"; do
        [ -d "$item" ] || continue
        local_links+=("$item"); mounts+=(-v "$item:$item:ro")
        compgen -G "$item/${torch_spec/==/-}-*.whl" >/dev/null && torch_here=1
    done
    for item in "${indexes[@]}"; do
        path="${item#file://}"
        if [ "$path" != "$item" ]; then
            [ -d "$path" ] || continue
            mounts+=(-v "$(dirname "$path"):$(dirname "$path"):ro")
        fi
        local_indexes+=("$item")
    done
    [ "$torch_here" = 1 ] || local_indexes+=("https://download.pytorch.org/whl/cpu")
    {
        echo "[global]"
        echo "cert = /etc/ssl/certs/ca-certificates.crt"
        echo "disable-pip-version-check = true"
        [ ${#local_links[@]} = 0 ] || echo "find-links = ${local_links[*]}"
        [ ${#local_indexes[@]} = 0 ] || echo "extra-index-url = ${local_indexes[*]}"
    } >"$conf"
    PIP_MOUNTS=("${mounts[@]}" -v "$conf:/etc/pip.conf:ro")
}
pip_sources

# An image of an earlier run that was stopped before its cleanup (kill -9, a machine shut down) is named after a
# process that is gone: removed, 1.2 GB each.
podman images --format '{{.Repository}}' | sed -n 's|^localhost/aiak-check-\([0-9][0-9]*\)$|\1|p' | sort -u \
    | while read -r pid; do
        kill -0 "$pid" 2>/dev/null || podman rmi -f "localhost/aiak-check-$pid:latest" >/dev/null 2>&1 || true
    done

# -- 2. base -----------------------------------------------------------------------------------------------------
debian="localhost/aiak-check-debian:$suite"
key="$( (echo "$suite $torch_spec"; cat docker/cpu-base.Dockerfile) | sha256sum | cut -c1-12)"
base="localhost/aiak-check-base:$key"

make_debian() {
    bounded mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" \
        "$scratch/rootfs.tar"
    bounded podman import -q "$scratch/rootfs.tar" "$debian" >/dev/null
    rm -f "$scratch/rootfs.tar"
}
make_base() {
    bounded podman build --pull=never --force-rm -f docker/cpu-base.Dockerfile --build-arg "DEBIAN_ROOTFS=$debian" \
        --build-arg "TORCH=$torch_spec" "${PIP_MOUNTS[@]}" -t "$base" docker >"$scratch/base.log" 2>&1 \
        || { tail -n 40 "$scratch/base.log" >&2; return 1; }
}
if podman image exists "$base"; then
    echo "== base: $base (cached)"
else
    podman image exists "$debian" || step "base: Debian $suite (mmdebstrap, import)" make_debian
    step "base: $torch_spec in a venv" make_base
fi

# -- 3. build ----------------------------------------------------------------------------------------------------
build_image() {
    bounded podman build --pull=never --force-rm -f docker/Dockerfile --build-arg "BASE_IMAGE=$base" "${PIP_MOUNTS[@]}" \
        --ignorefile docker/Dockerfile.dockerignore -t "$image" . >"$scratch/build.log" 2>&1 \
        || { tail -n 40 "$scratch/build.log" >&2; return 1; }
    smoke_report "$scratch/build.log"
}
# LOG of a build: print the smoke check's count. Its layer prints the count when built; a build of the same tree on
# this machine before (a kept image, a run stopped before its cleanup) reuses that layer, and step 4 runs doctor on
# the image anyway. A log with neither fails.
smoke_report() {
    if grep -qE "^[0-9]+ pass" "$1"; then
        grep -E "^[0-9]+ pass" "$1" | sed 's/^/    build smoke check (aiak doctor): /'
    elif grep -A1 -E "^STEP [0-9/]+: RUN aiak doctor" "$1" | grep -q "^--> Using cache"; then
        echo "    build smoke check (aiak doctor): its layer came from the engine's cache (it passed when built)"
    else
        tail -n 40 "$1" >&2; echo "the build printed no smoke check (aiak doctor) count" >&2; return 1
    fi
}
step "build docker/Dockerfile on the base" build_image

# -- 4. run ------------------------------------------------------------------------------------------------------
run() { bounded podman run --rm --label "$run_id" "$@"; }
# The way docker/README.md tells users to start it (--shm-size instead of --ipc=host: this machine's /dev/shm is
# small, and the point is the container's own). A container cannot get more than this machine's hard limits: where
# locked memory is capped (8 MiB in this kind of sandbox), memlock=-1 is left out and said so.
proper=(--shm-size=1g "${engine_limits[@]}")
for limit_flag in "memlock l -1" "stack s 67108864"; do
    read -r name letter value <<<"$limit_flag"
    hard="$(ulimit -H"$letter")"
    if [ "$hard" = unlimited ] || { [ "$value" != -1 ] && [ "$hard" -ge $((value / 1024)) ]; }; then
        proper+=(--ulimit "$name=$value")
    else
        echo "note: --ulimit $name=$value left out: this machine's hard limit is $hard KiB"
    fi
done

version() { run "$image" aiak --version; }
step "aiak --version" version

default_run() {
    local out rc=0
    out="$(run "$image" 2>&1)" || rc=$?
    echo "$out" | grep -A1 -E "^ +(pass|warn|fail) +/dev/shm" | sed 's/^ */    /'
    echo "$out" | tail -n 2 | sed 's/^/    /'
    [ "$rc" = 0 ] || { echo "$out" >&2; echo "the default command exited $rc under a default run" >&2; return 1; }
    echo "$out" | grep -qE -- "--ipc=host|--shm-size" \
        || { echo "the default command did not say how to start the container properly" >&2; return 1; }
    rc=0
    run "$image" aiak doctor >/dev/null 2>&1 || rc=$?
    echo "    asked to check, aiak doctor exits $rc under a default run"
    [ "$rc" != 0 ] || { echo "aiak doctor passed a container with a small /dev/shm" >&2; return 1; }
}
step "default run: starts, exit 0, shm advice" default_run

doctor() {
    local rc=0
    run "${proper[@]}" "$image" aiak doctor >"$scratch/doctor.log" 2>&1 || rc=$?
    tail -n 1 "$scratch/doctor.log" | sed 's/^/    /'
    [ "$rc" -le 1 ] || { cat "$scratch/doctor.log" >&2; return 1; }
}
step "aiak doctor (--shm-size=1g)" doctor

demo() {
    run "${proper[@]}" "$image" aiak demo --epochs 1 --samples 512 --batch-size 32 --rounds 6 \
        >"$scratch/demo.log" 2>&1 || { cat "$scratch/demo.log" >&2; return 1; }
    grep -v '^ *$' "$scratch/demo.log" | tail -n 2 | sed 's/^ */    /'
}
step "aiak demo (short)" demo

# The tests are mounted away from the source tree, in a folder without aiak/: `import aiak` must find the
# package pip installed into the image, which the first command asserts.
TESTS=(tests/test_api.py tests/strategy/test_profiles.py tests/cli/test_doctor.py)
tests() {
    run "${proper[@]}" "${PIP_MOUNTS[@]}" -v "$PWD/tests:/checks/tests:ro" -v "$PWD/pyproject.toml:/checks/pyproject.toml:ro" \
        -w /checks "$image" sh -c '
            set -e
            python -c "import aiak, sys; where = aiak.__file__; print(\"    aiak imported from\", where); sys.exit(\"site-packages\" not in where)"
            pip install -q pytest pytest-timeout
            python -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib "$@"' sh "${TESTS[@]}" \
            >"$scratch/tests.log" 2>&1 \
        || { tail -n 60 "$scratch/tests.log" >&2; return 1; }
    grep -E "aiak imported from|passed|failed" "$scratch/tests.log" | tail -n 2
}
step "tests against the installed package" tests

# -- 5. two containers, one torchrun job -------------------------------------------------------------------------
multinode() {
    local node out="$scratch/multinode" rc i
    mkdir -p "$out"
    podman network create "$network" >"$out/network.log" 2>&1 || { cat "$out/network.log" >&2; return 1; }
    for i in 0 1; do
        node="$run_id-node$i"
        podman run -d --label "$run_id" --name "$node" --hostname "$node" --network "$network" "${proper[@]}" \
            -e NODE_RANK="$i" -e MASTER="$run_id-node0" -e GPUS=1 -e GLOO_SOCKET_IFNAME=eth0 -e OMP_NUM_THREADS=1 \
            -e RDZV_TIMEOUT=120 -v "$out:/out" "$image" \
            examples/multinode.sh --device cpu --smoke --checksum-file /out/checksums --dist-timeout 120 \
            >"$out/start$i.log" 2>&1 || { cat "$out/start$i.log" >&2; return 1; }
    done
    for i in 0 1; do
        rc="$(bounded podman wait "$run_id-node$i")" || rc="still running after ${limit}s"
        podman logs "$run_id-node$i" >"$out/node$i.log" 2>&1 || true
        if [ "$rc" != 0 ]; then
            for node in 0 1; do echo "--- node $node ---" >&2; tail -n 30 "$out/node$node.log" >&2; done
            echo "node $i exited $rc" >&2
            return 1
        fi
    done
    grep -E "^aiak.comm: DDP over|^before/after" "$out/node0.log" | sed 's/^/    /' || true
    sed 's/^/    /' "$out/checksums"
    [ "$(wc -l <"$out/checksums")" = 2 ] || { echo "expected 2 weight checksums" >&2; return 1; }
    [ "$(awk '{print $3}' "$out/checksums" | sort -u | wc -l)" = 1 ] \
        || { echo "the two ranks ended with different weights" >&2; return 1; }
    echo "    2 containers, 2 gloo ranks: both exited 0 with identical weights"
}
step "2 containers: torchrun job over the engine's network" multinode

# The archive is checked the way a user gets the image from it: the built image is removed, the archive loaded
# and the loaded image run.
save_image() {
    rm -f "$save"
    bounded podman save -q --format oci-archive -o "$save" "$image"
    echo "    $save: $(du -m "$save" | cut -f1) MB"
    podman rmi -f "$image" >/dev/null
    bounded podman load -q -i "$save" | sed 's/^/    /'
    run "$image" aiak --version | sed 's/^/    loaded and run: /'
}
[ -z "$save" ] || step "save the image as an OCI archive, load it back" save_image

# -- report ------------------------------------------------------------------------------------------------------
size_mb() { echo $(( $(podman image inspect --format '{{.Size}}' "$1") / 1000000 )); }
echo
echo "docker/check.sh: passed"
printf '  %s\n' "${timings[@]}"
echo "  image $(size_mb "$image") MB on a base of $(size_mb "$base") MB ($base)"
