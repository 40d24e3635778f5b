#!/bin/bash
# Setting G's GPU version (README.md, "GPU version") on an offline GPU machine, beside bench/gpu_check.py's checks,
# once scripts/offline_stage.py has installed the stack staged by scripts/carry_offline.sh into STACK:
#
#   bash research/settings/g_simonsays/gpu_run.sh start STACK WORK CHECKS_END    # returns once both have started
#   bash research/settings/g_simonsays/gpu_run.sh collect STACK WORK DEST END    # returns after END, results in DEST
#
# start copies this checkout to WORK (the runs outlive the call that starts them; a carried checkout may change under
# them), starts the design's command detached, and the GPU checks, detached too, once the embedded model is
# converted (by the runs' shared evaluation, which comes first), to end by CHECKS_END (seconds since the epoch).
# collect reads the runs 8 minutes after their start (the design's budget rule), stops the runs and checks started
# from WORK at END (seconds since the epoch; other processes on the machine go on), reads them again, and packs the
# records (no weights) into DEST in parts of at most 15 MiB.
# CONFIG and OUTPUT run another setting's GPU version the same way (setting H's: research/settings/h_step_credit).
set -euo pipefail
step=$1 stack=$2 work=$3
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
output=${OUTPUT:-outputs/learning_simonsays_gpu} config=${CONFIG:-research/configs/learning_simonsays_gpu.yaml}
analyze() {  # the design's collection: the last held-out evaluation every run reached
  python3 research/learning.py --analyze-only --cut-at-common-evaluation --seeds 0 1 2 3 --config "$config" \
    --output "$output" > "$output/analysis_$1.txt" 2>&1 || echo "analysis at $1 failed: see $output/analysis_$1.txt"
  for file in summary.json learning_curves.csv learning_curves.png; do
    [ -f "$output/$file" ] && cp "$output/$file" "$output/${file%.*}_$1.${file##*.}"
  done
  return 0
}
stop_own_processes() {  # the runner, its runs and the checks started from this checkout (WORK), not another's
  local pid
  for pid in $(pgrep -f "research/learning.py|recipes/train_gigpo.py|bench/gpu_check.py"); do
    [ "$(readlink "/proc/$pid/cwd")" = "$PWD" ] && kill "$pid" 2>/dev/null || true
  done
}
case $step in
start)
  checks_end=$4
  rm -rf "$work" && mkdir -p "$work"
  tar --exclude=./.carry --exclude=./outputs --exclude=./.venv --exclude=./.venv-vllm -cf - . | tar -C "$work" -xf -
  cd "$work"
  ln -s ../environments gigpo_trl/environments  # the package's folder that setup.cfg maps, without an install
  source "$stack/env.sh"
  mkdir -p "$output" outputs/gpu_check
  date +%s > "$output.started"
  OMP_NUM_THREADS=1 python3 research/learning.py --parallel --detach --config "$config" \
    --model embedded:SmolLM2-135M-Instruct --shared-base-evaluation --seeds 0 1 2 3 --output "$output" \
    ${LEARNING_ARGS:-}  # a CPU dry-run's smaller scale (README.md)
  model=$(python3 -c "from gigpo_trl.models import embedded_model_dir; print(embedded_model_dir())")
  setsid bash -c "until [ -d '$model' ]; do sleep 2; done
    OMP_NUM_THREADS=2 exec python3 bench/gpu_check.py --jobs 6 --time-limit \$(( $checks_end - \$(date +%s) )) \
      --only gpu_tests vllm_colocate_lora vllm_colocate_lora_adapter vllm_server qlora_vllm_adapter \
        vllm_sleep_mode_lora_adapter qlora vllm_colocate vllm_sleep_mode train_full_bf16 train_lora_bf16 \
        deepspeed_zero2 deepspeed_zero3 update_memory rollout_throughput \
      --vllm-kv-cache-gib 2 --vllm-gpu-memory-utilization 0.05 --output-dir outputs/gpu_check \
      --summary outputs/gpu_check/gpu.md" > outputs/gpu_check/run.log 2>&1 < /dev/null &
  echo "started at $(cat "$output.started"): the runs (log $work/$output/learning.log) and the checks (until $checks_end)"
  ;;
collect)
  dest=$4 end=$5
  cd "$work"
  source "$stack/env.sh"
  started=$(cat "$output.started")
  sleep $(( started + 480 - $(date +%s) > 0 ? started + 480 - $(date +%s) : 0 ))
  analyze 8min
  sleep $(( end - $(date +%s) > 0 ? end - $(date +%s) : 0 ))
  stop_own_processes
  sleep 3
  analyze end
  nvidia-smi > outputs/nvidia-smi.txt 2>&1 || true
  tar --exclude='*.safetensors' --exclude='*.bin' --exclude='checkpoint-*' -czf /tmp/records.tgz \
    "$output" "$output.started" outputs/gpu_check outputs/nvidia-smi.txt
  split -b 15m -d /tmp/records.tgz "$dest/records.tgz.part"
  cp "$output/summary_end.json" "$dest/" 2>/dev/null || true
  cp outputs/gpu_check/gpu.md "$dest/" 2>/dev/null || true
  ls -la "$dest"
  ;;
esac
