# slime_launch.sh: the part every stoa launch script shares, sourced after it has set its settings,
# `fail`, PROG, DRY_RUN, EXTRA_ARGS and the argument arrays MODEL_ARGS, CKPT_ARGS, ROLLOUT_ARGS,
# LOSS_ARGS, OPTIMIZER_ARGS and PERF_ARGS: the remaining slime flags, the custom-config YAML, stoa's
# slime patch check, `stoa preflight`, `ray start --head` (unless a Ray cluster already answers) and
# `ray job submit ... python3 $SLIME_DIR/train.py FLAGS`; with --dry-run it prints them instead.
# shellcheck shell=bash

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
RUNTIME_ENV_JSON="{\"env_vars\": {${ENV_VARS}}}"

PATCH_CMD=("$PYTHON" "${STOA_DIR}/scripts/apply_slime_patches.py" "$SLIME_DIR" --check)
PREFLIGHT_CMD=("$STOA" preflight --store "$STOA_STORE" --run "$STOA_RUN" --slime-dir "$SLIME_DIR" -- "${SLIME_ARGS[@]}")
RAY_START_CMD=(ray start --head --node-ip-address "$RAY_HEAD_IP" --num-gpus "$NUM_GPUS" --disable-usage-stats
  --dashboard-port "$RAY_DASHBOARD_PORT")
SUBMIT_CMD=(ray job submit --address="http://${RAY_HEAD_IP}:${RAY_DASHBOARD_PORT}" --runtime-env-json="$RUNTIME_ENV_JSON"
  -- python3 "${SLIME_DIR}/train.py" "${SLIME_ARGS[@]}")

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

if [ "$DRY_RUN" = 1 ]; then
  echo "# dry run: nothing is run or written"
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
