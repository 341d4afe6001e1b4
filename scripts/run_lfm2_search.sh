#!/usr/bin/env bash
# run_lfm2_search.sh: launch slime as stoa's trainer, LFM2.5-8B-A1B (LFM2-MoE) on the search task.
#
# As scripts/run_qwen25_gsm8k.sh (rollouts from the bucket, stoa's DPPO loss, weights published
# after every step), with the model built by stoa's LFM2 provider
# (--custom-model-provider-path slime_stoa.trainer.slime.lfm2.spec.provider) and its model flags
# derived from the HF folder's config.json (python -m slime_stoa.trainer.slime.lfm2.flags).
# A fresh start loads the Megatron torch_dist checkpoint REF_LOAD (MODEL_DIR_torch_dist), which
# `--convert` writes once with slime's tools/convert_hf_to_torch_dist.py and the provider (whose
# import registers stoa's LFM2 HF loader with slime); a launch without it stops and says so.
#
# Parallelism: one GPU of 80-180 GB (TP 1: LFM2's conv layers are not tensor-parallel; EP_SIZE
# divides the 32 experts when there are more GPUs). The optimizer runs on the CPU by default
# (OPTIMIZER_OFFLOAD=1: fp32 master weights, Adam moments and gradients in host memory: ~174 GiB
# with slime's backup and the publisher's copies, by the accounting in docs/slime.md); see
# docs/slime.md, "LFM2 / LFM2.5-8B-A1B".
#
# Before the first launch: create and seed the run (stoa run create, stoa task prepare search,
# stoa weights publish-anchor), apply stoa's slime patch and convert the model (`--convert`); see
# docs/slime.md. To resume, run the same command again.
#
# Bucket credentials: export AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY before running this (the
# Ray processes started here inherit them) or use an env file (~/.r2env for r2://,
# ~/.config/stoa/credentials.env for s3://, or STOA_ENV_FILE). They never appear on a command line.
set -euo pipefail

PROG=${0##*/}
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"

# -- settings (environment variables; defaults after :-) ------------------------------------------
STOA_DIR=${STOA_DIR:-"$(dirname -- "$SCRIPT_DIR")"}           # this stoa checkout
SLIME_DIR=${SLIME_DIR:-/root/slime}                           # slime checkout (train.py)
MEGATRON_DIR=${MEGATRON_DIR:-/root/Megatron-LM}               # Megatron-LM checkout (put on PYTHONPATH)
STOA_STORE=${STOA_STORE:-"file://${STOA_DIR}/bucket"}         # bucket URL: file://, s3://...?endpoint=, r2://
STOA_RUN=${STOA_RUN:-lfm2-search}                             # run name in the bucket
MODEL_NAME=${MODEL_NAME:-LFM2.5-8B-A1B}
MODEL_DIR=${MODEL_DIR:-"/root/${MODEL_NAME}"}                 # HF checkpoint (config, tokenizer, weights)
REF_LOAD=${REF_LOAD:-"${MODEL_DIR}_torch_dist"}               # the same model in Megatron torch_dist format (--convert)
SAVE_DIR=${SAVE_DIR:-"/root/stoa-ckpt/${STOA_RUN}"}           # Megatron checkpoints (also loaded: resume)
SAVE_INTERVAL=${SAVE_INTERVAL:-20}                            # rollouts between checkpoints
CONFIG_PATH=${CONFIG_PATH:-"${SAVE_DIR}/stoa-config.yaml"}    # the custom-config YAML written here
NUM_GPUS=${NUM_GPUS:-1}                                       # training GPUs on this node
EP_SIZE=${EP_SIZE:-1}                                         # expert parallel size (divides num_experts)
OPTIMIZER_OFFLOAD=${OPTIMIZER_OFFLOAD:-1}                     # 1: Adam on the CPU (needed below ~160 GB)
RECOMPUTE=${RECOMPUTE:-1}                                     # 1: full activation recompute
NUM_ROLLOUT=${NUM_ROLLOUT:-500}                               # training rollouts (steps of the outer loop)
ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE:-32}                  # prompt groups per rollout
GROUP_SIZE=${GROUP_SIZE:-8}                                   # = the run's group_size
TEMPERATURE=${TEMPERATURE:-1.0}                               # = the run's temperature
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-4096}                    # >= the run's max_tokens (all turns and observations)
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$((ROLLOUT_BATCH_SIZE * GROUP_SIZE))}  # samples per optimizer step
MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU:-16384}               # dynamic batching budget per micro-batch
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

Launch slime as stoa's GPU trainer: ${MODEL_NAME} (LFM2-MoE) on the search task, rollouts from
the bucket, DPPO loss, weights published to the bucket after every step.

options:
  --dry-run   print the custom-config YAML and every command; run and write nothing
              (works without the model folder: the model args become a placeholder)
  --convert   write REF_LOAD, the Megatron checkpoint of MODEL_DIR (slime's
              tools/convert_hf_to_torch_dist.py with stoa's LFM2 provider), and stop
  -h, --help  show this help
  --          the rest are extra slime flags, appended last (the last occurrence wins)

settings (environment variables, current values):
  STOA_STORE=${STOA_STORE}
  STOA_RUN=${STOA_RUN}
  SLIME_DIR=${SLIME_DIR}   MEGATRON_DIR=${MEGATRON_DIR}   STOA_DIR=${STOA_DIR}
  MODEL_NAME=${MODEL_NAME}   MODEL_DIR=${MODEL_DIR}   REF_LOAD=${REF_LOAD}
  SAVE_DIR=${SAVE_DIR}   SAVE_INTERVAL=${SAVE_INTERVAL}   CONFIG_PATH=${CONFIG_PATH}
  NUM_GPUS=${NUM_GPUS}   EP_SIZE=${EP_SIZE}   OPTIMIZER_OFFLOAD=${OPTIMIZER_OFFLOAD}   RECOMPUTE=${RECOMPUTE}
  NUM_ROLLOUT=${NUM_ROLLOUT}   ROLLOUT_BATCH_SIZE=${ROLLOUT_BATCH_SIZE}   GROUP_SIZE=${GROUP_SIZE} (= the run's group_size)
  TEMPERATURE=${TEMPERATURE} (= the run's temperature)   MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN} (>= its max_tokens)
  GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE}   MAX_TOKENS_PER_GPU=${MAX_TOKENS_PER_GPU}   LR=${LR}
  STALENESS_LIMIT=${STALENESS_LIMIT:-<run manifest>}   REUSE_LIMIT=${REUSE_LIMIT:-<run manifest>}
  DPPO_DELTA_LOW=${DPPO_DELTA_LOW}   DPPO_DELTA_HIGH=${DPPO_DELTA_HIGH}
  DPPO_RATIO_CAP=${DPPO_RATIO_CAP}   DPPO_DUAL_CLIP=${DPPO_DUAL_CLIP}
  WANDB_PROJECT=${WANDB_PROJECT:-<off>}   RAY_HEAD_IP=${RAY_HEAD_IP}   RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT}
  PYTHON=${PYTHON}   STOA=${STOA}   SKIP_PREFLIGHT=${SKIP_PREFLIGHT}

Dense LFM2 or another LFM2-MoE: set MODEL_NAME / MODEL_DIR; the model flags follow its config.json.
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

# -- model args from the HF folder's config.json ---------------------------------------------------
MODEL_ARGS=()
if [ -f "${MODEL_DIR}/config.json" ]; then
  FLAGS=$(PYTHONPATH="${STOA_DIR}${PYTHONPATH:+:${PYTHONPATH}}" "$PYTHON" -m slime_stoa.trainer.slime.lfm2.flags "$MODEL_DIR") \
    || fail "could not read the LFM2 model flags from ${MODEL_DIR}/config.json (see above)"
  read -r -a MODEL_ARGS <<< "$FLAGS"
elif [ "$DRY_RUN" = 1 ]; then
  MODEL_ARGS=("<MODEL_ARGS from python -m slime_stoa.trainer.slime.lfm2.flags ${MODEL_DIR}>")
else
  fail "no ${MODEL_DIR}/config.json: download the model (hf download LiquidAI/${MODEL_NAME} --local-dir ${MODEL_DIR}) or set MODEL_DIR"
fi

# -- slime flags ----------------------------------------------------------------------------------
CKPT_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --custom-model-provider-path slime_stoa.trainer.slime.lfm2.spec.provider
  --ref-load "$REF_LOAD"
  --load "$SAVE_DIR"
  --save "$SAVE_DIR"
  --save-interval "$SAVE_INTERVAL"
)

OPTIMIZER_EXTRA_ARGS=()
if [ "$OPTIMIZER_OFFLOAD" = 1 ]; then
  OPTIMIZER_EXTRA_ARGS=(--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer)
fi

# TP 1 (the conv layers are replicated; the provider refuses more), experts over EP.
PERF_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --expert-model-parallel-size "$EP_SIZE"
  --expert-tensor-parallel-size 1
  --moe-grouped-gemm
  --use-dynamic-batch-size
  --max-tokens-per-gpu "$MAX_TOKENS_PER_GPU"
)
if [ "$RECOMPUTE" = 1 ]; then
  PERF_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
fi

# --convert: what slime's converter needs beside MODEL_ARGS to build the same model.
CONVERT_ARGS=(--custom-model-provider-path slime_stoa.trainer.slime.lfm2.spec.provider --moe-grouped-gemm)

# -- the shared rest: rollout, loss and optimizer flags, custom config, patch check, preflight, Ray -
# shellcheck source=scripts/slime_launch.sh
source "${SCRIPT_DIR}/slime_launch.sh"
