#!/usr/bin/env bash
# Training that survives crashes: torchrun restarts every worker after one dies, and each start resumes from
# the newest checkpoint (`fit --ckpt_path last`; the very first start finds none and begins from scratch).
#
#   scripts/train_resilient.sh [--max-restarts K] [--nproc_per_node G] [--nnodes N --node_rank R --rdzv HOST:PORT]
#                              [FIT ARGS...]
#
#   --max-restarts    restarts allowed before torchrun gives up (default 3)
#   --nproc_per_node  processes on this node, one per GPU (default 1)
#   --nnodes, --node_rank, --rdzv   for several nodes: run this on each node with the same --rdzv HOST:PORT
#                     (default: one node, rendezvous on 127.0.0.1 at a free port)
#
# A crash loses at most the steps since the last checkpoint (configs/default.yaml refreshes last.ckpt every
# 50 optimizer steps and at every epoch end). A run stopped by SIGTERM saves last.ckpt and exits 143, which
# torchrun also restarts; stop the whole job by signalling torchrun itself. Example, 4 GPUs:
#   scripts/train_resilient.sh --nproc_per_node 4 --config configs/ddp.yaml
# On CPU (as the tests do): ... --nproc_per_node 2 --trainer.accelerator cpu --trainer.strategy ddp
set -euo pipefail

restarts=3 nproc=1 nnodes=1 node_rank=0 rdzv=""
while [[ $# -gt 0 ]]; do
    case $1 in
    --max-restarts) restarts=${2:?}; shift 2 ;;
    --nproc_per_node) nproc=${2:?}; shift 2 ;;
    --nnodes) nnodes=${2:?}; shift 2 ;;
    --node_rank) node_rank=${2:?}; shift 2 ;;
    --rdzv) rdzv=${2:?}; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) break ;;
    esac
done
PY=${PYTHON:-python}
if [[ -z $rdzv ]]; then
    rdzv="127.0.0.1:$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi

set -x
exec "$PY" -m torch.distributed.run \
    --nnodes "$nnodes" --node_rank "$node_rank" --nproc_per_node "$nproc" --max-restarts "$restarts" \
    --rdzv-backend c10d --rdzv-endpoint "$rdzv" \
    -m project fit "$@" --trainer.num_nodes "$nnodes" --trainer.devices "$nproc" --ckpt_path last
