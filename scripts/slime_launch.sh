# slime_launch.sh: the part every stoa launch script shares, sourced after it has set its settings,
# `fail`, PROG, DRY_RUN, CONVERT, EXTRA_ARGS and the argument arrays MODEL_ARGS, CKPT_ARGS,
# PERF_ARGS, OPTIMIZER_EXTRA_ARGS and CONVERT_ARGS: the remaining slime flags (stoa's rollouts and
# loss, the optimizer), the custom-config YAML, stoa's slime patch check, `stoa preflight`,
# `ray start --head` (unless a Ray cluster already answers) and
# `ray job submit ... python3 $SLIME_DIR/train.py FLAGS`; with --dry-run it prints them instead.
#
# With --convert it runs slime's tools/convert_hf_to_torch_dist.py instead (MODEL_ARGS, then
# CONVERT_ARGS, --hf-checkpoint MODEL_DIR --save REF_LOAD): the Megatron torch_dist checkpoint a
# fresh launch starts from (--ref-load). A launch with no Megatron checkpoint in SAVE_DIR or
# REF_LOAD stops before anything runs and says to convert.
# shellcheck shell=bash

# The slime commit stoa is tested against (SLIME_COMMIT in slime_stoa/trainer/slime/preflight_slime_api.py;
# docs/slime.md): a checkout elsewhere gets a warning here, and preflight checks every slime name stoa uses.
SLIME_COMMIT=624b824a898ab0ec1fcb4d373004c7f3852bf515

# stoa's rollouts from the bucket (no SGLang engines) and its DPPO loss.
ROLLOUT_ARGS=(
  --rollout-num-gpus 0
  --rollout-function-path slime_stoa.generate_rollout
  --data-source-path slime_stoa.StoaDataSource
  --num-rollout "$NUM_ROLLOUT"
  --rollout-batch-size "$ROLLOUT_BATCH_SIZE"
  --n-samples-per-prompt "$GROUP_SIZE"
  --rollout-temperature "$TEMPERATURE"
  --rollout-top-p 1.0
  --rollout-max-response-len "$MAX_RESPONSE_LEN"
  --global-batch-size "$GLOBAL_BATCH_SIZE"
)

LOSS_ARGS=(
  --advantage-estimator grpo
  --loss-type custom_loss
  --custom-loss-function-path slime_stoa.dppo_loss
  --use-rollout-logprobs
  --calculate-per-token-loss
  --entropy-coef 0.0
)

OPTIMIZER_ARGS=(
  --optimizer adam
  --lr "$LR"
  --lr-decay-style constant
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.98
  ${OPTIMIZER_EXTRA_ARGS[@]+"${OPTIMIZER_EXTRA_ARGS[@]}"}
)

MISC_ARGS=(
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32
  --attention-backend flash
  --custom-config-path "$CONFIG_PATH"
)

CLUSTER_ARGS=(
  --actor-num-nodes 1
  --actor-num-gpus-per-node "$NUM_GPUS"
)

WANDB_ARGS=()
if [ -n "$WANDB_PROJECT" ]; then
  WANDB_ARGS=(--use-wandb --wandb-project "$WANDB_PROJECT" --wandb-group "$STOA_RUN")
fi

SLIME_ARGS=(
  "${CLUSTER_ARGS[@]}"
  "${MODEL_ARGS[@]}"
  "${CKPT_ARGS[@]}"
  "${ROLLOUT_ARGS[@]}"
  "${LOSS_ARGS[@]}"
  "${OPTIMIZER_ARGS[@]}"
  "${PERF_ARGS[@]}"
  "${MISC_ARGS[@]}"
  ${WANDB_ARGS[@]+"${WANDB_ARGS[@]}"}
  ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
)

# -- the custom-config YAML (slime sets every key on its args, in every process) -------------------
yaml_str() {  # a YAML double-quoted scalar
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "$s"
}

custom_config() {
  echo "# written by $PROG; keys documented in slime_stoa/trainer/slime/rollout.py, slime_stoa/trainer/slime/publish.py, slime_stoa/trainer/slime/loss.py"
  echo "stoa_publish: true"
  echo "stoa_bucket: $(yaml_str "$STOA_STORE")"
  echo "stoa_run: $(yaml_str "$STOA_RUN")"
  if [ -n "$STALENESS_LIMIT" ]; then echo "stoa_staleness_limit: $STALENESS_LIMIT"; fi
  if [ -n "$REUSE_LIMIT" ]; then echo "stoa_reuse_limit: $REUSE_LIMIT"; fi
  # The trainer's own copies of what it signs (run manifest, registry, pointer, manifests, its
  # state): a bucket writer's delete or overwrite is put back instead of stopping the run.
  echo "stoa_keep_dir: $(yaml_str "${KEEP_DIR:-${SAVE_DIR}/stoa-kept}")"
  echo "stoa_prefetch_groups: $ROLLOUT_BATCH_SIZE"
  echo "dppo_delta_low: $DPPO_DELTA_LOW"
  echo "dppo_delta_high: $DPPO_DELTA_HIGH"
  echo "dppo_ratio_cap: $DPPO_RATIO_CAP"
  echo "dppo_dual_clip: $DPPO_DUAL_CLIP"
  echo "dppo_reduction: token_mean"
}

# -- Ray ------------------------------------------------------------------------------------------
json_str() {  # a JSON string
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "$s"
}

# Every Ray worker must import slime_stoa, slime and megatron: put all three on PYTHONPATH.
WORKER_PYTHONPATH="${MEGATRON_DIR}:${STOA_DIR}:${SLIME_DIR}"
ENV_VARS="\"PYTHONPATH\": $(json_str "$WORKER_PYTHONPATH"), \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\", \"PYTHONUNBUFFERED\": \"1\""
if [ -n "${STOA_ENV_FILE:-}" ]; then
  ENV_VARS="${ENV_VARS}, \"STOA_ENV_FILE\": $(json_str "$STOA_ENV_FILE")"
fi
if [ -n "${TENSORBOARD_DIR:-}" ]; then  # where slime's --use-tensorboard writes (its own variable)
  ENV_VARS="${ENV_VARS}, \"TENSORBOARD_DIR\": $(json_str "$TENSORBOARD_DIR")"
fi
RUNTIME_ENV_JSON="{\"env_vars\": {${ENV_VARS}}}"

PATCH_CMD=("$PYTHON" "${STOA_DIR}/scripts/apply_slime_patches.py" "$SLIME_DIR" --check)
PREFLIGHT_CMD=("$STOA" preflight --store "$STOA_STORE" --run "$STOA_RUN" --slime-dir "$SLIME_DIR" -- "${SLIME_ARGS[@]}")
RAY_START_CMD=(ray start --head --node-ip-address "$RAY_HEAD_IP" --num-gpus "$NUM_GPUS" --disable-usage-stats
  --dashboard-port "$RAY_DASHBOARD_PORT")
SUBMIT_CMD=(ray job submit --address="http://${RAY_HEAD_IP}:${RAY_DASHBOARD_PORT}" --runtime-env-json="$RUNTIME_ENV_JSON"
  -- python3 "${SLIME_DIR}/train.py" "${SLIME_ARGS[@]}")
CONVERT_CMD=(env PYTHONPATH="$WORKER_PYTHONPATH" "$PYTHON" "${SLIME_DIR}/tools/convert_hf_to_torch_dist.py"
  "${MODEL_ARGS[@]}" ${CONVERT_ARGS[@]+"${CONVERT_ARGS[@]}"} --hf-checkpoint "$MODEL_DIR" --save "$REF_LOAD")

shq() {  # ARG quoted for a POSIX shell: bare when safe, else in single quotes
  case "$1" in
    '' | *[!A-Za-z0-9_@%+=:,./-]*) printf "'%s'" "${1//\'/\'\\\'\'}" ;;
    *) printf '%s' "$1" ;;
  esac
}

show() {  # print a command, each word shell-quoted
  local sep=""
  for word in "$@"; do
    printf '%s' "$sep"
    shq "$word"
    sep=" "
  done
  printf '\n'
}

if [ "$CONVERT" = 1 ]; then
  if [ "$DRY_RUN" = 1 ]; then
    echo "# dry run: nothing is run or written"
    echo "# convert ${MODEL_DIR} to Megatron torch_dist in ${REF_LOAD}:"
    show "${CONVERT_CMD[@]}"
    exit 0
  fi
  [ -f "${SLIME_DIR}/tools/convert_hf_to_torch_dist.py" ] \
    || fail "no tools/convert_hf_to_torch_dist.py in SLIME_DIR=${SLIME_DIR}: set SLIME_DIR to the slime checkout"
  "${CONVERT_CMD[@]}" || fail "the conversion of ${MODEL_DIR} failed (see above)"
  echo "$PROG: wrote the Megatron checkpoint ${REF_LOAD}; launch with the same settings, without --convert"
  exit 0
fi

if [ "$DRY_RUN" = 1 ]; then
  echo "# dry run: nothing is run or written"
  echo "# slime: stoa is tested against commit ${SLIME_COMMIT} (git -C ${SLIME_DIR} checkout ${SLIME_COMMIT})"
  echo "# custom config (written to ${CONFIG_PATH}):"
  custom_config
  echo "# commands:"
  show "${PATCH_CMD[@]}"
  show "${PREFLIGHT_CMD[@]}"
  show "${RAY_START_CMD[@]}"
  show "${SUBMIT_CMD[@]}"
  exit 0
fi

[ -f "${SLIME_DIR}/train.py" ] || fail "no train.py in SLIME_DIR=${SLIME_DIR}: set SLIME_DIR to the slime checkout"
SLIME_HEAD=$(git -C "$SLIME_DIR" rev-parse HEAD 2>/dev/null || true)
if [ -n "$SLIME_HEAD" ] && [ "$SLIME_HEAD" != "$SLIME_COMMIT" ]; then
  echo "$PROG: warning: slime in ${SLIME_DIR} is at ${SLIME_HEAD:0:12}, stoa is tested against ${SLIME_COMMIT:0:12}" \
    "(\`git -C ${SLIME_DIR} checkout ${SLIME_COMMIT}\`); preflight checks the slime names stoa uses" >&2
fi
# A fresh start reads --ref-load, a resume SAVE_DIR: one of them must be a Megatron checkpoint.
[ -f "${SAVE_DIR}/latest_checkpointed_iteration.txt" ] || [ -f "${REF_LOAD}/latest_checkpointed_iteration.txt" ] \
  || fail "no Megatron checkpoint in REF_LOAD=${REF_LOAD} (nor in SAVE_DIR): convert ${MODEL_DIR} first: \`${PROG} --convert\` runs slime's tools/convert_hf_to_torch_dist.py (\`${PROG} --convert --dry-run\` prints it)"
mkdir -p "$(dirname -- "$CONFIG_PATH")" "$SAVE_DIR"
custom_config > "$CONFIG_PATH"
echo "$PROG: wrote $CONFIG_PATH"

export PYTHONPATH="${WORKER_PYTHONPATH}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1

if [ "$SKIP_PREFLIGHT" != 1 ]; then
  rc=0
  "${PATCH_CMD[@]}" || rc=$?
  if [ "$rc" -eq 1 ]; then
    fail "stoa's slime patch is not applied: run \`$PYTHON ${STOA_DIR}/scripts/apply_slime_patches.py ${SLIME_DIR}\`"
  elif [ "$rc" -ne 0 ]; then
    fail "stoa's slime patch does not fit ${SLIME_DIR} (see above)"
  fi
  "${PREFLIGHT_CMD[@]}" || fail "preflight found problems (FIX lines above); nothing was launched"
fi

if ray status --address "${RAY_HEAD_IP}:6379" >/dev/null 2>&1; then
  echo "$PROG: using the Ray cluster already running at ${RAY_HEAD_IP}"
else
  "${RAY_START_CMD[@]}"
fi

exec "${SUBMIT_CMD[@]}"
