#!/usr/bin/env bash
# Train in the background, detached from the terminal: the run survives logout and is stopped cleanly.
#
#   scripts/train_bg.sh start NAME [FIT ARGS...]   start `python -m project fit FIT ARGS` in the background
#   scripts/train_bg.sh status NAME                running (pid), or the exit code it ended with
#   scripts/train_bg.sh stop NAME                  SIGTERM, wait for the run to exit, print its exit code
#   tail -f logs/NAME.log                          watch it
#
# Files: logs/NAME.log (stdout and stderr), logs/NAME.pid (the training process), logs/NAME.exit (its exit code,
# written when it ends). Environment: LOG_DIR (default logs), PYTHON (default python), STOP_TIMEOUT (seconds
# `stop` waits, default 300; a run finishing its current step and saving may take a while). CUDA_VISIBLE_DEVICES
# and the rest of the environment pass through:
#   CUDA_VISIBLE_DEVICES=2,3 scripts/train_bg.sh start exp1 --trainer.devices 2
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
cmd=$1 name=$2
shift 2
dir=${LOG_DIR:-logs}
log=$dir/$name.log pidfile=$dir/$name.pid exitfile=$dir/$name.exit

running_pid() {  # prints the pid if the run is alive
    [[ -f $pidfile ]] || return 1
    local pid
    pid=$(<"$pidfile")
    kill -0 "$pid" 2>/dev/null && echo "$pid"
}

case $cmd in
start)
    if pid=$(running_pid); then
        echo "$name is already running (pid $pid); stop it first or choose another name" >&2
        exit 1
    fi
    mkdir -p "$dir"
    rm -f "$pidfile" "$exitfile"
    # setsid: a session of its own, so the terminal's hangup never reaches it; nohup: ignore SIGHUP anyway.
    # The small shell around python stays to record the exit code, which nobody else could collect.
    setsid nohup bash -c '
        "$1" -m project fit "${@:4}" &
        echo $! > "$2"
        wait $!
        echo $? > "$3"
    ' bash "${PYTHON:-python}" "$pidfile" "$exitfile" "$@" >>"$log" 2>&1 </dev/null &
    for _ in $(seq 50); do [[ -s $pidfile ]] && break; sleep 0.1; done
    echo "started $name (pid $(<"$pidfile")): log $log"
    ;;
status)
    if pid=$(running_pid); then
        echo "$name is running (pid $pid)"
    elif [[ -f $exitfile ]]; then
        echo "$name exited with code $(<"$exitfile")"
    else
        echo "$name is not running and left no exit code (never started, or killed with its shell)"
        exit 1
    fi
    ;;
stop)
    if ! pid=$(running_pid); then
        echo "$name is not running" >&2
        exit 1
    fi
    kill -TERM "$pid"
    echo "sent SIGTERM to $name (pid $pid); waiting up to ${STOP_TIMEOUT:-300} s for it to exit"
    deadline=$((SECONDS + ${STOP_TIMEOUT:-300}))
    while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            echo "$name (pid $pid) still runs after ${STOP_TIMEOUT:-300} s; kill -KILL $pid forces it" >&2
            exit 1
        fi
        sleep 0.2
    done
    for _ in $(seq 50); do [[ -s $exitfile ]] && break; sleep 0.1; done
    code=$(cat "$exitfile" 2>/dev/null || echo unknown)
    echo "$name exited with code $code"
    ;;
*)
    usage
    ;;
esac
