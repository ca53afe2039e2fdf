#!/usr/bin/env bash
# Multi-node training with torchrun: run this once on every node, same arguments except --node_rank.
#
#   scripts/torchrun.sh --nnodes N --node_rank R --rdzv HOST:PORT --nproc_per_node G [FIT ARGS...]
#
#   --nnodes          number of nodes
#   --node_rank       this node's rank, 0 .. N-1; node 0 hosts the rendezvous and holds global rank 0, the one
#                     that writes runs/ (so runs/ appears on node 0)
#   --rdzv            HOST:PORT of node 0, reachable from every node (e.g. 10.0.0.1:29500)
#   --nproc_per_node  processes on this node: one per GPU
#
# torchrun starts the processes and sets RANK, WORLD_SIZE, MASTER_ADDR, ...; Lightning detects them and wires
# DDP itself; no rank logic here. The script only appends --trainer.num_nodes N --trainer.devices G to FIT ARGS
# (e.g. --config configs/ddp.yaml), so that the Trainer expects the processes torchrun starts; being last, they
# win over any --config (configs/ddp.yaml says devices: auto). Two nodes with 8 GPUs each:
#   node 0:  scripts/torchrun.sh --nnodes 2 --node_rank 0 --rdzv 10.0.0.1:29500 --nproc_per_node 8
#   node 1:  scripts/torchrun.sh --nnodes 2 --node_rank 1 --rdzv 10.0.0.1:29500 --nproc_per_node 8
# Static rendezvous (torchrun's default): global ranks follow --node_rank, unlike c10d's first-come order.
# torchrun runs as `python -m lightkeep.torchrun`: when a rank or a node is lost, each node's output ends in one
# line naming it, the newest checkpoint and the command below that resumes the job (this one with --ckpt_path last,
# on every node), not in torchrun's traceback (docs/checkpoints.md, 'Across machines').
# PYTHON (default python) picks the interpreter.
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2; exit 2; }
nnodes="" node_rank="" rdzv="" nproc=""
while [[ $# -gt 0 ]]; do
    case $1 in
    --nnodes) nnodes=${2:?}; shift 2 ;;
    --node_rank) node_rank=${2:?}; shift 2 ;;
    --rdzv) rdzv=${2:?}; shift 2 ;;
    --nproc_per_node) nproc=${2:?}; shift 2 ;;
    -h | --help) usage ;;
    *) break ;;  # the rest goes to `fit`
    esac
done
if [[ -z $nnodes || -z $node_rank || -z $rdzv || -z $nproc ]]; then
    echo "--nnodes, --node_rank, --rdzv and --nproc_per_node are all required" >&2
    usage
fi

# The command that resumes this job on this node: the same, from the newest checkpoint (lightkeep.rank_failures)
resume=("$0" --nnodes "$nnodes" --node_rank "$node_rank" --rdzv "$rdzv" --nproc_per_node "$nproc")
skip=0
for arg in "$@"; do
    if ((skip)); then skip=0; continue; fi
    case $arg in
    --ckpt_path) skip=1 ;;
    --ckpt_path=*) ;;
    *) resume+=("$arg") ;;
    esac
done
printf -v PROJECT_RESUME '%q ' "${resume[@]}" --ckpt_path last
if ((nnodes > 1)); then PROJECT_RESUME+="(on every node, each with its own --node_rank)"; fi
export PROJECT_RESUME=${PROJECT_RESUME% }

set -x
exec "${PYTHON:-python}" -m lightkeep.torchrun \
    --nnodes "$nnodes" --node_rank "$node_rank" --nproc_per_node "$nproc" \
    --rdzv_backend static --rdzv_endpoint "$rdzv" \
    -m project fit "$@" --trainer.num_nodes "$nnodes" --trainer.devices "$nproc"
