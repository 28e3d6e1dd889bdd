#!/usr/bin/env bash
# Multi-node training with torchrun: aiak's hierarchical allreduce and fp16 gradient compression.
#
# Run the same command on every node; node 0 must be the machine at $MASTER (it hosts the rendezvous):
#
#   NODE_RANK=0 MASTER=10.0.0.1 GPUS=8 examples/multinode.sh [training script options]
#   NODE_RANK=1 MASTER=10.0.0.1 GPUS=8 examples/multinode.sh [training script options]
#
# which runs, on each node,
#
#   torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node $GPUS \
#            --rdzv-backend c10d --rdzv-endpoint $MASTER:29500 \
#            --rdzv-conf is_host=<1 on node 0>,join_timeout=300,read_timeout=300 --max-restarts 0 \
#            examples/train_transformer.py --hierarchical true --compression fp16 [options]
#
# The training script leaves the model to aiak.optimize, which wraps it in DDP with the strategy's
# comm: {hierarchical: true, compression: fp16}: gradients are reduce-scattered inside each node, one shard per
# local rank crosses the network (as fp16: half the bytes), and are all-gathered back inside the node.
# Hierarchical allreduce made Swin training 85% faster on 4 nodes x 8 GPUs over 25 Gb/s TCP;
# `sudo python benchmarks/comm_netns.py --quick` measures it here (hierarchical 1.48x, +fp16 2.95x flat).
#
# Settings (environment): NODE_RANK (required), MASTER (required: address of node 0), GPUS (default: the GPUs
# nvidia-smi lists), NNODES (2), PORT (29500), SCRIPT (examples/train_transformer.py), TORCHRUN (the launcher
# command, torchrun), RDZV_TIMEOUT (seconds to wait for every node to join, 300), RDZV_ID (a job id shared by
# the nodes, aiak-multinode), LOCAL_ADDR (this node's address as the others reach it, when its host name
# resolves to another interface).
#
# NCCL settings that `aiak doctor` checks (export them on every node before running this script):
#   NCCL_SOCKET_IFNAME=eth0      interface of the inter-node network (NCCL's own choice can be a docker or
#                                virtual bridge, and then every allreduce fails or crawls); also ^lo,docker0
#   NCCL_IB_HCA=mlx5_0,mlx5_1    the InfiniBand / RoCE adapters to use (`ibv_devices` lists them), or
#   NCCL_IB_DISABLE=1            no InfiniBand: TCP sockets over NCCL_SOCKET_IFNAME
#   NCCL_NET_GDR_LEVEL=PHB       GPUDirect RDMA (NIC reads GPU memory directly) up to this PCI distance
#   NCCL_DEBUG=INFO              print the transport chosen at start-up: "NET/IB ... GDRDMA" is RDMA with GPUDirect,
#                                "NET/Socket" means TCP (check NCCL_IB_HCA if you have InfiniBand)
#
# Local mode: the same job on this one machine, as 2 simulated nodes x 2 gloo ranks on the CPU. Two network
# namespaces joined by a veth pair (10.231.13.1 and 10.231.13.2) play the nodes; each runs one torchrun agent
# (node 0 hosts the rendezvous). Every rank appends its weight checksum to a file, and the run passes only if all
# 4 ranks exit 0 and the 4 checksums are equal. The namespaces are deleted afterwards, also on failure or Ctrl-C.
# Needs root and `ip netns`.
#
#   sudo examples/multinode.sh --local [training script options]     (default options: --smoke)
#
# LOCAL_TIMEOUT (seconds, default 240) bounds the whole local run.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SCRIPT="${SCRIPT:-$here/train_transformer.py}"
PORT="${PORT:-29500}"
NNODES="${NNODES:-2}"
RDZV_TIMEOUT="${RDZV_TIMEOUT:-300}"
RDZV_ID="${RDZV_ID:-aiak-multinode}"
read -r -a TORCHRUN_CMD <<<"${TORCHRUN:-torchrun}"   # e.g. TORCHRUN="python3 -m torch.distributed.run"
COMM_OPTIONS=(--hierarchical true --compression fp16)

die() { echo "multinode.sh: $*" >&2; exit 2; }

# CMD := torchrun for one node: $1 node rank, $2 rendezvous host, $3 ranks on this node, $4 this node's address
# for the others to reach it ("" = its host name); the rest goes to the training script.
node_command() {
    local node_rank="$1" master="$2" nproc="$3" local_addr="$4"
    shift 4
    local is_host=0
    [ "$node_rank" = 0 ] && is_host=1
    CMD=("${TORCHRUN_CMD[@]}" --nnodes "$NNODES" --node-rank "$node_rank" --nproc-per-node "$nproc"
         --rdzv-backend c10d --rdzv-endpoint "$master:$PORT" --rdzv-id "$RDZV_ID"
         --rdzv-conf "is_host=$is_host,join_timeout=$RDZV_TIMEOUT,read_timeout=$RDZV_TIMEOUT" --max-restarts 0)
    [ -z "$local_addr" ] || CMD+=(--local-addr "$local_addr")
    CMD+=("$SCRIPT" "${COMM_OPTIONS[@]}" "$@")
}

run_cluster() {
    [ -n "${NODE_RANK:-}" ] || die "set NODE_RANK (0 on the node at \$MASTER, 1 on the other), or use --local"
    [ -n "${MASTER:-}" ] || die "set MASTER to the address of node 0 (the rendezvous host), or use --local"
    local gpus="${GPUS:-}"
    if [ -z "$gpus" ]; then
        command -v nvidia-smi >/dev/null || die "set GPUS (ranks per node): nvidia-smi is not here to count them"
        gpus="$(nvidia-smi --list-gpus | wc -l)"
    fi
    node_command "$NODE_RANK" "$MASTER" "$gpus" "${LOCAL_ADDR:-}" "$@"
    exec "${CMD[@]}"
}

run_local() {
    [ "$(id -u)" = 0 ] || die "--local needs root: it creates network namespaces (run it with sudo)"
    command -v ip >/dev/null && ip netns list >/dev/null 2>&1 || die "--local needs 'ip netns' (iproute2)"
    [ $# -gt 0 ] || set -- --smoke
    local tag="aiakm$$" addrs=(10.231.13.1 10.231.13.2) limit="${LOCAL_TIMEOUT:-240}"
    local dev=("${tag}v0" "${tag}v1")
    ns=("${tag}n0" "${tag}n1")   # global, like work: the EXIT trap runs after this function has returned
    work="$(mktemp -d)"
    cleanup() {
        local n
        for n in "${ns[@]}"; do  # first every process we started in our namespaces, then the namespaces
            ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
            ip netns del "$n" 2>/dev/null || true   # takes its end of the veth pair with it
        done
        rm -rf "$work"
    }
    trap cleanup EXIT
    trap 'exit 130' INT TERM

    local i
    for i in 0 1; do ip netns add "${ns[$i]}"; done
    ip link add "${dev[0]}" type veth peer name "${dev[1]}"
    for i in 0 1; do
        ip link set "${dev[$i]}" netns "${ns[$i]}"
        ip netns exec "${ns[$i]}" ip addr add "${addrs[$i]}/24" dev "${dev[$i]}"
        ip netns exec "${ns[$i]}" ip link set "${dev[$i]}" up
        ip netns exec "${ns[$i]}" ip link set lo up
    done
    echo "multinode.sh --local: nodes ${ns[0]} (${addrs[0]}) and ${ns[1]} (${addrs[1]}), 2 gloo ranks each"

    local pids=()
    for i in 0 1; do
        node_command "$i" "${addrs[0]}" 2 "${addrs[$i]}" --device cpu --checksum-file "$work/checksums" \
            --dist-timeout 120 "$@"
        ip netns exec "${ns[$i]}" env GLOO_SOCKET_IFNAME="${dev[$i]}" OMP_NUM_THREADS=1 \
            timeout --kill-after=10 "$limit" "${CMD[@]}" >"$work/node$i.log" 2>&1 &
        pids+=("$!")
    done
    local failed=0
    for i in 0 1; do
        if ! wait "${pids[$i]}"; then failed=1; fi
    done
    if [ "$failed" = 1 ]; then
        for i in 0 1; do echo "--- node $i (last lines) ---" >&2; tail -n 40 "$work/node$i.log" >&2; done
        die "a node failed or ran past ${limit}s"
    fi
    grep -E "^aiak.comm: DDP over|^padded tokens|^before/after" "$work/node0.log" || true
    sort "$work/checksums"
    local ranks digests
    ranks="$(wc -l <"$work/checksums")"
    digests="$(awk '{print $3}' "$work/checksums" | sort -u | wc -l)"
    [ "$ranks" = 4 ] || die "expected 4 weight checksums, got $ranks"
    [ "$digests" = 1 ] || die "the 4 ranks ended with different weights ($digests different checksums)"
    echo "multinode.sh --local: 4 ranks on 2 nodes, all exited 0, weights identical on every rank"
}

case "${1:-}" in
    --local) shift; run_local "$@" ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
    *) run_cluster "$@" ;;
esac
