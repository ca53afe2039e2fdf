#!/usr/bin/env bash
# Training that survives crashes: when the run dies, it is started again with `fit --ckpt_path last` and resumes
# from the newest checkpoint (the very first start finds none and begins from scratch).
#
#   scripts/train_resilient.sh [--max-restarts K] [--torchrun --nproc_per_node G [--nnodes N --rdzv HOST:PORT]]
#                              [FIT ARGS...]
#
#   --max-restarts K  restarts allowed before giving up (default 3)
#   default launcher  this script restarts `python -m project fit ... --ckpt_path last` after a non-zero exit;
#                     Lightning starts the processes of one node (--trainer.devices N), each start on a fresh port
#   --torchrun        torchrun --max-restarts K --rdzv-backend c10d restarts the workers instead (multi-node,
#                     elastic); --nproc_per_node, --nnodes and --rdzv are passed to it. It runs as
#                     `python -m lightkeep.torchrun`: a lost rank or node is said in one line, not a traceback
#
# A crash loses at most the steps since the last checkpoint (configs/default.yaml refreshes last.ckpt every
# 10 minutes of training and at every epoch end). Exit 0 ends the loop, and so does a preempted run (exit 143, it
# saved last.ckpt) or a Ctrl-C (130): those are the scheduler's or the user's decision, not a crash. Examples:
#   scripts/train_resilient.sh --config configs/ddp.yaml --trainer.devices 4
#   scripts/train_resilient.sh --torchrun --nproc_per_node 8 --nnodes 2 --rdzv 10.0.0.1:29500 --config configs/ddp.yaml
# torchrun's agent shares its rendezvous store with the workers' process group by default, and after it restarts
# them a rank may connect to the address its peer registered in the previous attempt ("Connection refused"): on 2
# CPU ranks with gloo (torch 2.13) 2 of 4 restarted jobs burned 1 or 2 more restarts that way, 0 of 6 with
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which --torchrun sets for its torchrun command (a store per attempt).
# https://github.com/pytorch/pytorch/issues/135712 (closed, the stale address still seen here)
set -uo pipefail

restarts=3 use_torchrun=0 nproc=1 nnodes=1 rdzv="127.0.0.1:0"
while [[ $# -gt 0 ]]; do
    case $1 in
    --max-restarts) restarts=${2:?}; shift 2 ;;
    --torchrun) use_torchrun=1; shift ;;
    --nproc_per_node) nproc=${2:?}; shift 2 ;;
    --nnodes) nnodes=${2:?}; shift 2 ;;
    --rdzv) rdzv=${2:?}; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    *) break ;;
    esac
done
PY=${PYTHON:-python}

if [[ $use_torchrun == 1 ]]; then
    set -x
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 exec "$PY" -m lightkeep.torchrun --nnodes "$nnodes" --nproc_per_node "$nproc" --max-restarts "$restarts" \
        --rdzv-backend c10d --rdzv-endpoint "$rdzv" \
        -m project fit "$@" --trainer.num_nodes "$nnodes" --trainer.devices "$nproc" --ckpt_path last
fi

# A run whose rank died writes the one-line report here (engine/lightkeep/rank_failures.py); the restart repeats it.
report=$(mktemp)
trap 'rm -f "$report"' EXIT
for ((attempt = 0; ; attempt++)); do
    : >"$report"
    PROJECT_FAILURE_REPORT=$report "$PY" -m project fit "$@" --ckpt_path last
    rc=$?
    why="exit code $rc"
    if [[ -s $report ]]; then why="exit code $rc: $(head -n 1 "$report")"; fi
    if [[ $rc == 0 || $rc == 130 || $rc == 143 ]]; then
        exit $rc
    fi
    if ((attempt >= restarts)); then
        echo "train_resilient: $why; giving up after $restarts restarts" >&2
        exit $rc
    fi
    echo "train_resilient: $why; restart $((attempt + 1)) of $restarts from the newest checkpoint" >&2
done
