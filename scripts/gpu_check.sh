#!/usr/bin/env bash
# The checks that need a GPU, as one script for a GPU machine: 5-7 min on one H200 (2026-12-04, torch 2.11,
# Lightning 2.6.6; each step has a time limit; one past it is killed and reported):
#
#   scripts/gpu_check.sh [--cpu] [OUT_DIR]        (default OUT_DIR: gpu_check_out; run from the project folder)
#
# 1. sharded (configs/fsdp.yaml over gpu.yaml): a fit, the same fit SIGKILLed mid-epoch and resumed; the final
#    weights and optimizer state must be bit-equal (deterministic: warn keeps every kernel the MLP uses exact)
# 2. throughput and memory per rank, DDP vs sharded, on an MLP of ~200M parameters (800 MB, 2.4 GB with AdamW)
# 3. each of MLP, CNN and tests.gpu_nets.MixedOpsNet (conv, embedding, interpolation, SDPA attention) fits without
#    an error under gpu.yaml, gpu.yaml + ddp.yaml and gpu.yaml + fsdp.yaml
# 4. host-device syncs per optimizer step of (a) the hand loop, (b) plain Lightning, (c) the template
#    (scripts/count_syncs.py: the ops that read a device value, and CUDA's own count with
#    torch.cuda.set_sync_debug_mode("warn") beside it), in 1 process and on 2 DDP ranks, each rank counted (with 2
#    GPUs or more: a GPU each, NCCL; with one GPU, which NCCL will not share between ranks, and with --cpu: 2 CPU
#    processes, gloo; the hand loop's ranks always on the CPU), and their step time and samples/s
#    (scripts/benchmark.py, on the CPU: the hand loop runs there only); both in the background from the start, the
#    benchmark pinned to the last CPU
# 5. a transformer (tests.gpu_nets.TinyTransformer, ~100M parameters) under gpu.yaml, torch.compile on and off:
#    step time and model FLOPs utilisation (6 x parameters x tokens per step over the step time and the H200's
#    ~989 TFLOPS dense bf16; PEAK_FLOPS overrides)
# Every figure ends up in one table, OUT_DIR/table.md (scripts/gpu_check_table.py), printed at the end.
# Uses min(2, #GPUs) devices. Every step runs even if an earlier one failed; the summary at the end lists them, the
# logs are in OUT_DIR, and the exit code is the number of failed steps. --cpu runs the same steps on 2 CPU processes
# with small sizes and without compile/workers (gpu.yaml with speed.compile false: OUT_DIR/gpu_nocompile.yaml),
# to check the script itself on a machine without a GPU; there the limits are not applied.
# PYTHON (default python) picks the interpreter.
set -uo pipefail
PY=${PYTHON:-python}
CPU=0
if [[ "${1:-}" == "--cpu" ]]; then CPU=1; shift; fi
OUT=$(realpath -m "${1:-gpu_check_out}")
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
rm -f "$OUT/steps.txt"
# the engine's test fixtures (tests.faults, tests.gpu_nets: engine/tests) before the project (its package)
ENGINE_TESTS=$([[ -d "$REPO/engine/tests" ]] && echo "$REPO/engine:" || true)
export PYTHONPATH="$ENGINE_TESTS$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
# gpu.yaml without torch.compile (speed.compile false): the --cpu runs, and the transformer's compile-off run; every
# step below reads it, so a gpu.yaml this cannot rewrite stops the check here
"$PY" - "$REPO/configs/gpu.yaml" "$OUT/gpu_nocompile.yaml" <<'EOF' || { echo "gpu_check: cannot write gpu_nocompile.yaml" >&2; exit 2; }
import sys

import yaml

config = yaml.safe_load(open(sys.argv[1]))
assert config["speed"]["compile"] is True, "gpu.yaml does not set speed.compile: true"
config["speed"]["compile"] = False
open(sys.argv[2], "w").write(yaml.safe_dump(config, sort_keys=False))
EOF

QUIET=(--trainer.enable_progress_bar false --trainer.enable_model_summary false)
if ((CPU)); then
  DEVICES=2
  GPU=(--config "$OUT/gpu_nocompile.yaml" --trainer.accelerator cpu --data.num_workers 0 --data.pin_memory false
       --data.persistent_workers false)
  NOCOMPILE=("${GPU[@]}")
  BIG=(--model.net.init_args.hidden_sizes "[1024,1024,1024]")
  STEPS=6
  SYNC_EPOCHS=1 BENCH=(--epochs 1 --repeats 1)
  SYNC_DDP=cpu
  TRANSFORMER=(--model.net.init_args.width 64 --model.net.init_args.depth 2 --model.net.init_args.heads 4)
  T_BATCH=64 T_EPOCHS=2
else
  NGPU=$(nvidia-smi -L | wc -l)
  DEVICES=$((NGPU < 2 ? NGPU : 2))
  GPU=(--config "$REPO/configs/gpu.yaml")
  NOCOMPILE=(--config "$OUT/gpu_nocompile.yaml")
  BIG=(--model.net.init_args.hidden_sizes "[8192,8192,8192,8192]")
  STEPS=40
  SYNC_EPOCHS=2 BENCH=(--epochs 4 --repeats 3 --cpus "$(($(nproc) - 1))")
  SYNC_DDP=$( ((NGPU >= 2)) && echo gpu || echo cpu)  # NCCL needs a GPU per rank
  TRANSFORMER=(--model.net.init_args.width 1024 --model.net.init_args.depth 8 --model.net.init_args.heads 16)
  T_BATCH=256 T_EPOCHS=10  # 4 full batches an epoch (no partial one to recompile for): 40 steps
fi
FSDP=(--config "$REPO/configs/fsdp.yaml" --trainer.devices "$DEVICES")
DDP=(--config "$REPO/configs/ddp.yaml" --trainer.devices "$DEVICES")

step() {  # step NAME TIMEOUT_S CMD...: runs CMD (a shell function too) with its output in OUT/NAME.log, records
  local name=$1 limit=$(( CPU ? 3600 : $2 )) start=$SECONDS rc  # PASS or FAIL; past TIMEOUT_S its whole process group is killed
  shift 2
  set -m  # the step gets a process group of its own, for the watchdog to kill with every process it started
  "$@" >"$OUT/$name.log" 2>&1 &
  local pid=$!
  set +m
  (sleep "$limit" && echo "timed out after $limit s" >>"$OUT/$name.log" && kill -KILL -- "-$pid") 2>/dev/null &
  local watchdog=$!
  wait "$pid"
  rc=$?
  kill "$watchdog" 2>/dev/null
  if ((rc == 0)); then  # one line per step in OUT/steps.txt (steps in the background too)
    echo "PASS  $name ($((SECONDS - start)) s)" >>"$OUT/steps.txt"
  else
    echo "FAIL  $name ($((SECONDS - start)) s, exit $rc): see $OUT/$name.log" >>"$OUT/steps.txt"
  fi
}

fit() {  # fit RUN_ROOT ARGS...
  local root=$1
  shift
  # PYTHONSAFEPATH: python -m does not put the working folder first, where the template's own tests/ would hide the
  # engine's (the scripts run by path keep their folder on the path: they import their neighbours)
  PYTHONSAFEPATH=1 "$PY" -m project fit --run.root "$root" "${QUIET[@]}" "$@"
}

# 4. in the background, one after the other (the hand loop runs on the CPU only, so all of the benchmark does:
#    CUDA_VISIBLE_DEVICES is emptied for it; the sync counter sees the GPU, where (b) and (c) then run)
figures() {
  if [[ ! -f "$REPO/scripts/count_syncs.py" ]]; then  # the template's scripts; a copy made from it has none
    echo "SKIP  count_syncs, benchmark (the template's scripts, not in a copy)" >>"$OUT/steps.txt"
    return
  fi
  step count_syncs 360 "$PY" "$REPO/scripts/count_syncs.py" --epochs "$SYNC_EPOCHS" --ranks 1,2 \
    --ddp-accelerator "$SYNC_DDP" --json "$OUT/syncs.json"
  step benchmark 300 env CUDA_VISIBLE_DEVICES= "$PY" "$REPO/scripts/benchmark.py" "${BENCH[@]}"
}
if ((CPU)); then figures; else figures & FIGURES=$!; fi

# 1. sharded fit, kill, exact resume: 2 epochs of 8 steps, last.ckpt every 3 steps, killed at step 11 (resumes
#    from step 9, mid-epoch), compared with the uninterrupted run
EXACT=("${GPU[@]}" "${FSDP[@]}" --trainer.max_epochs 2 --trainer.limit_train_batches 8 --trainer.limit_val_batches 2
       --model.warmup 1 --trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint
       --trainer.callbacks.every_n_train_steps=3 --trainer.callbacks.save_top_k=0 --trainer.callbacks.save_last=true
       --trainer.callbacks.enable_version_counter=false)
exact_resume() {
  fit "$OUT/exact/reference" "${EXACT[@]}" || return 1
  fit "$OUT/exact/resumed" "${EXACT[@]}" --trainer.callbacks+=tests.faults.KillAt --trainer.callbacks.step=11
  echo "killed run exited $? (expected 137 or -9)"
  fit "$OUT/exact/resumed" "${EXACT[@]}" --ckpt_path last || return 1
  "$PY" - "$OUT/exact" <<'EOF'
import sys
from pathlib import Path

import torch

from lightkeep.sharded.folders import full_state_dict

root = Path(sys.argv[1])
ref, got = (root / f"{k}/digits/version_0/checkpoints/last.ckpt" for k in ("reference", "resumed"))
bad = 0
for part in ("state_dict.", "optimizer_0."):
    a, b = full_state_dict(ref, part), full_state_dict(got, part)
    for key in a:
        d = (a[key].double() - b[key].double()).abs().max().item()
        bad += not torch.equal(a[key], b[key])
        print(f"{part}{key}: max |d| = {d:.3g}")
print("exact resume:", "BIT-EQUAL" if bad == 0 else f"{bad} tensors differ")
sys.exit(bad > 0)
EOF
}
step sharded_exact_resume 180 exact_resume

# 2. throughput and peak memory per rank, DDP vs sharded (a model that fits on one GPU)
MEM=("${GPU[@]}" "${BIG[@]}" --trainer.max_epochs 1 --trainer.limit_train_batches "$STEPS" --trainer.limit_val_batches 1
     --trainer.num_sanity_val_steps 0 --trainer.enable_checkpointing false --trainer.logger false
     --trainer.callbacks+=tests.faults.MemoryProbe)
step memory_ddp 90 fit "$OUT/mem" "${MEM[@]}" "${DDP[@]}" "--trainer.callbacks.out_dir=$OUT/mem/ddp"
step memory_sharded 90 fit "$OUT/mem" "${MEM[@]}" "${FSDP[@]}" "--trainer.callbacks.out_dir=$OUT/mem/sharded"

# 3. the example nets and a net of the ops without deterministic kernels, under each overlay; the three nets of an
#    overlay run at the same time (the GPU has room), each in its own run root
NETS=(project.nets.MLP project.nets.CNN tests.gpu_nets.MixedOpsNet)
SHORT=(--trainer.max_epochs 1 --trainer.limit_train_batches 10 --trainer.limit_val_batches 2)
overlay() {  # overlay NAME ARGS...: the three nets at once; fails if any fails
  local name=$1 pids=() status=0
  shift
  for net in "${NETS[@]}"; do
    fit "$OUT/overlays/$name/${net##*.}" "${GPU[@]}" "$@" "${SHORT[@]}" --model.net "$net" \
      >"$OUT/overlay_${name}_${net##*.}.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { echo "${NETS[$i]} failed: $OUT/overlay_${name}_${NETS[$i]##*.}.log"; status=1; }
  done
  return $status
}
step overlay_gpu 100 overlay gpu --trainer.devices 1
step overlay_gpu_ddp 100 overlay gpu_ddp "${DDP[@]}"
step overlay_gpu_fsdp 100 overlay gpu_fsdp "${FSDP[@]}"
# the start line of each CUDA run under deterministic: warn names what that gives up (docs/engine.md's table)
warn_named() {
  local name net log missing=0
  for name in gpu gpu_ddp gpu_fsdp; do
    for net in "${NETS[@]}"; do
      log="$OUT/overlay_${name}_${net##*.}.log"
      grep -q "opts out: .*deterministic: warn: ops with no deterministic CUDA kernel" "$log" ||
        { echo "not named: $log"; missing=1; }
    done
  done
  return $missing
}
((CPU)) || step start_line_names_deterministic_warn 10 warn_named

# 5. the transformer, torch.compile on and off (on the CPU off only: compiling there takes minutes)
#    lr 3e-4: at the example's 3e-3 the 100M-parameter transformer diverges by itself once warmup ends (a plain
#    torch loop, no engine, gets a non-finite gradient at step 10 on an H200; at 1e-3 at step 20; at 3e-4 none in 40),
#    and the engine rightly stops the fit
T=(--trainer.devices 1 --model.net tests.gpu_nets.TinyTransformer "${TRANSFORMER[@]}" --data.batch_size "$T_BATCH"
   --model.lr 3e-4
   --trainer.max_epochs "$T_EPOCHS" --trainer.limit_train_batches 4 --trainer.limit_val_batches 0
   --trainer.num_sanity_val_steps 0 --trainer.enable_checkpointing false --trainer.logger false
   --trainer.callbacks+=tests.faults.MemoryProbe)
((CPU)) || step transformer_compile 120 fit "$OUT/transformer" "${GPU[@]}" "${T[@]}" \
  "--trainer.callbacks.out_dir=$OUT/transformer/compile"
step transformer_eager 60 fit "$OUT/transformer" "${NOCOMPILE[@]}" "${T[@]}" \
  "--trainer.callbacks.out_dir=$OUT/transformer/eager"
[[ -n "${FIGURES:-}" ]] && wait "$FIGURES"

echo
echo "== gpu_check ($( ((CPU)) && echo "CPU fallback" || nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $DEVICES devices)"
cat "$OUT/steps.txt"
grep -h "^exact resume:" "$OUT/sharded_exact_resume.log" 2>/dev/null
"$PY" - "$OUT/mem" <<'EOF'
import json
import sys
from pathlib import Path

print(f"{'strategy':16} {'rank':>4} {'params MB':>10} {'optim MB':>9} {'peak RSS MB':>12} {'peak CUDA MB':>13} {'steps/s':>8}")
for kind in ("ddp", "sharded"):
    for f in sorted((Path(sys.argv[1]) / kind).glob("rank*.json")):
        r = json.loads(f.read_text())
        print(f"{r['strategy']:16} {r['rank']:>4} {r['param_mb']:>10.1f} {r['optimizer_mb']:>9.1f} "
              f"{r['peak_rss_mb']:>12.0f} {r['peak_cuda_mb']:>13.0f} {r['steps_per_s']:>8.2f}")
EOF
echo
GPU_NAME=$( ((CPU)) && echo "CPU fallback" || nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
"$PY" "$REPO/scripts/gpu_check_table.py" "$OUT" $( ((CPU)) && echo --cpu) --tokens $((T_BATCH * 64)) \
  --peak-flops "${PEAK_FLOPS:-989e12}" --title "gpu_check ($GPU_NAME, $DEVICES devices)"
exit "$(grep -c '^FAIL' "$OUT/steps.txt")"
