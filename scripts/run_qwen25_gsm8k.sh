#!/usr/bin/env bash
# run_qwen25_gsm8k.sh: launch slime as stoa's trainer, Qwen2.5 (1.5B-Instruct by default) on GSM8K.
#
# slime starts no SGLang engines (--rollout-num-gpus 0): the rollout groups come from the bucket,
# where stoa's Mac workers put them (slime_stoa.generate_rollout), the loss is stoa's DPPO loss
# (slime_stoa.dppo_loss), and after every training step the patched update_weights
# publishes the new weights to the bucket (slime_stoa.trainer.slime.publish, switched on by
# `stoa_publish: true` in the custom-config YAML this script writes).
#
# Steps: write the custom-config YAML; check stoa's slime patch (scripts/apply_slime_patches.py
# --check); `stoa preflight` with the exact flags slime will get; `ray start --head` (unless a
# Ray cluster already answers); `ray job submit ... python3 $SLIME_DIR/train.py FLAGS`.
#
# Before the first launch: create and seed the run (stoa run create, stoa task prepare gsm8k,
# stoa weights publish-anchor) and convert the HF model to Megatron's torch_dist format
# (`--convert`); see docs/slime.md. To resume, run the same command again: slime loads the latest checkpoint in
# SAVE_DIR, and the rollout consumer and the weight publisher continue from their saved state.
#
# Bucket credentials: export AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY before running this (the
# Ray processes started here inherit them) or use an env file (~/.r2env for r2://,
# ~/.config/stoa/credentials.env for s3://, or STOA_ENV_FILE). They never appear on a command line.
set -euo pipefail

PROG=${0##*/}
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"

# -- settings (environment variables; defaults after :-) ------------------------------------------
STOA_DIR=${STOA_DIR:-"$(dirname -- "$SCRIPT_DIR")"}           # this stoa checkout
SLIME_DIR=${SLIME_DIR:-/root/slime}                           # slime checkout (train.py, scripts/models/)
MEGATRON_DIR=${MEGATRON_DIR:-/root/Megatron-LM}               # Megatron-LM checkout (put on PYTHONPATH)
STOA_STORE=${STOA_STORE:-"file://${STOA_DIR}/bucket"}         # bucket URL: file://, s3://...?endpoint=, r2://
STOA_RUN=${STOA_RUN:-qwen25-gsm8k}                            # run name in the bucket
MODEL_NAME=${MODEL_NAME:-Qwen2.5-1.5B-Instruct}
MODEL_ARGS_SCRIPT=${MODEL_ARGS_SCRIPT:-"${SLIME_DIR}/scripts/models/qwen2.5-1.5B.sh"}  # slime's model args
ROTARY_BASE=${ROTARY_BASE:-1000000}                           # rope_theta of every Qwen2.5 (see below)
MODEL_DIR=${MODEL_DIR:-"/root/${MODEL_NAME}"}                 # HF checkpoint (config, tokenizer, weights)
REF_LOAD=${REF_LOAD:-"${MODEL_DIR}_torch_dist"}               # the same model in Megatron torch_dist format (--convert)
SAVE_DIR=${SAVE_DIR:-"/root/stoa-ckpt/${STOA_RUN}"}           # Megatron checkpoints (also loaded: resume)
SAVE_INTERVAL=${SAVE_INTERVAL:-20}                            # rollouts between checkpoints
CONFIG_PATH=${CONFIG_PATH:-"${SAVE_DIR}/stoa-config.yaml"}    # the custom-config YAML written here
NUM_GPUS=${NUM_GPUS:-1}                                       # training GPUs on this node
TP_SIZE=${TP_SIZE:-1}                                         # tensor parallel size
NUM_ROLLOUT=${NUM_ROLLOUT:-500}                               # training rollouts (steps of the outer loop)
ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE:-32}                  # prompt groups per rollout
GROUP_SIZE=${GROUP_SIZE:-8}                                   # = the run's group_size
TEMPERATURE=${TEMPERATURE:-1.0}                               # = the run's temperature
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-1024}                    # >= the run's max_tokens
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((ROLLOUT_BATCH_SIZE * GROUP_SIZE))}  # samples per optimizer step
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-9216}                # dynamic batching budget per micro-batch
LR=${LR:-1e-6}
STALENESS_LIMIT=${STALENESS_LIMIT:-}                          # empty: the run manifest's staleness_limit
REUSE_LIMIT=${REUSE_LIMIT:-}                                  # empty: the run manifest's reuse_limit
DPPO_DELTA_LOW=${DPPO_DELTA_LOW:-0.2}                         # DPPO trust region below μ (A < 0)
DPPO_DELTA_HIGH=${DPPO_DELTA_HIGH:-0.2}                       # DPPO trust region above μ (A > 0)
DPPO_RATIO_CAP=${DPPO_RATIO_CAP:-2.0}                         # importance weight cap C
DPPO_DUAL_CLIP=${DPPO_DUAL_CLIP:-3.0}                         # dual-clip bound for A < 0
WANDB_PROJECT=${WANDB_PROJECT:-}                              # set to log to Weights & Biases
RAY_HEAD_IP=${RAY_HEAD_IP:-127.0.0.1}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
PYTHON=${PYTHON:-python3}
STOA=${STOA:-stoa}                                            # the stoa command
SKIP_PREFLIGHT=${SKIP_PREFLIGHT:-0}                           # 1: skip the patch check and preflight

usage() {
  cat <<EOF
usage: $PROG [--dry-run] [--convert] [-- EXTRA_SLIME_FLAGS...]

Launch slime as stoa's GPU trainer: ${MODEL_NAME} on GSM8K, rollouts from the bucket,
DPPO loss, weights published to the bucket after every step.

options:
  --dry-run   print the custom-config YAML and every command; run and write nothing
              (works without a slime checkout: the model args become a placeholder)
  --convert   write REF_LOAD, the Megatron checkpoint of MODEL_DIR (slime's
              tools/convert_hf_to_torch_dist.py), and stop
  -h, --help  show this help
  --          the rest are extra slime flags, appended last (the last occurrence wins)

settings (environment variables, current values):
  STOA_STORE=${STOA_STORE}
  STOA_RUN=${STOA_RUN}
  SLIME_DIR=${SLIME_DIR}   MEGATRON_DIR=${MEGATRON_DIR}   STOA_DIR=${STOA_DIR}
  MODEL_NAME=${MODEL_NAME}   MODEL_ARGS_SCRIPT=${MODEL_ARGS_SCRIPT}   ROTARY_BASE=${ROTARY_BASE}
  MODEL_DIR=${MODEL_DIR}   REF_LOAD=${REF_LOAD}
  SAVE_DIR=${SAVE_DIR}   SAVE_INTERVAL=${SAVE_INTERVAL}   CONFIG_PATH=${CONFIG_PATH}
  NUM_GPUS=${NUM_GPUS}   TP_SIZE=${TP_SIZE}   NUM_ROLLOUT=${NUM_ROLLOUT}
  ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE}   GROUP_SIZE=${GROUP_SIZE} (= the run's group_size)
  TEMPERATURE=${TEMPERATURE} (= the run's temperature)   MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN} (>= its max_tokens)
  GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE}   MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU}   LR=${LR}
  STALENESS_LIMIT=${STALENESS_LIMIT:-<run manifest>}   REUSE_LIMIT=${REUSE_LIMIT:-<run manifest>}
  DPPO_DELTA_LOW=${DPPO_DELTA_LOW}   DPPO_DELTA_HIGH=${DPPO_DELTA_HIGH}
  DPPO_RATIO_CAP=${DPPO_RATIO_CAP}   DPPO_DUAL_CLIP=${DPPO_DUAL_CLIP}
  WANDB_PROJECT=${WANDB_PROJECT:-<off>}   RAY_HEAD_IP=${RAY_HEAD_IP}   RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT}
  PYTHON=${PYTHON}   STOA=${STOA}   SKIP_PREFLIGHT=${SKIP_PREFLIGHT}

Other Qwen2.5 sizes: set MODEL_NAME (e.g. Qwen2.5-7B-Instruct) and MODEL_ARGS_SCRIPT
(\$SLIME_DIR/scripts/models/qwen2.5-7B.sh). See docs/slime.md.
EOF
}

fail() {
  echo "$PROG: error: $1" >&2
  exit 1
}

# -- command line ---------------------------------------------------------------------------------
DRY_RUN=0
CONVERT=0
EXTRA_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1 ;;
    --convert) CONVERT=1 ;;
    --) shift; EXTRA_ARGS=("$@"); break ;;
    *) echo "$PROG: error: unknown argument $1 (slime flags go after --)" >&2; echo "run \`$PROG --help\` for usage" >&2; exit 2 ;;
  esac
  shift
done

# -- model args from slime's scripts/models/ ------------------------------------------------------
MODEL_ARGS=()
if [ -f "$MODEL_ARGS_SCRIPT" ]; then
  # shellcheck source=/dev/null
  source "$MODEL_ARGS_SCRIPT"   # sets MODEL_ARGS=(--num-layers ... --vocab-size ...)
elif [ "$DRY_RUN" = 1 ]; then
  MODEL_ARGS=("<MODEL_ARGS from ${MODEL_ARGS_SCRIPT}>")
else
  fail "slime's model args $MODEL_ARGS_SCRIPT not found: set SLIME_DIR to the slime checkout (or MODEL_ARGS_SCRIPT)"
fi
# slime's qwen2.5-1.5B.sh sets --rotary-base 10000, but Qwen2.5's config.json has rope_theta 1e6 (slime's own
# HF check rejects the mismatch at start-up); the last occurrence of a flag wins, so this one is used.
MODEL_ARGS+=(--rotary-base "$ROTARY_BASE")

# -- slime flags ----------------------------------------------------------------------------------
CKPT_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --ref-load "$REF_LOAD"
  --load "$SAVE_DIR"
  --save "$SAVE_DIR"
  --save-interval "$SAVE_INTERVAL"
)

PERF_ARGS=(
  --tensor-model-parallel-size "$TP_SIZE"
  --sequence-parallel
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --expert-model-parallel-size 1
  --expert-tensor-parallel-size 1
  --use-dynamic-batch-size
  --max-tokens-per-gpu "$MAX_TOKENS_PER_GPU"
)

# -- the shared rest: rollout, loss and optimizer flags, custom config, patch check, preflight, Ray -
# shellcheck source=scripts/slime_launch.sh
source "${SCRIPT_DIR}/slime_launch.sh"
