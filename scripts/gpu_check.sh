#!/usr/bin/env bash
# gpu_check.sh: stoa's trainer on one CUDA GPU in slime's image, end to end, in 46 minutes at most
# (the checks' caps; see BUDGET).
#
#   scripts/gpu_check.sh [--dry-run]
#
# Prints one PASS/FAIL line per check and exits 0 only when every check ran and passed; a check
# that could not run (a check it needs failed, or the time budget is spent) is a FAIL
# "(not run: ...)":
#   gpu               torch sees a CUDA device
#   imports           megatron.core, transformer_engine, slime, and a transformers that knows lfm2_moe
#   patch             stoa's slime patch applied to SLIME_DIR (scripts/apply_slime_patches.py; idempotent)
#   tiny_models       tiny random LFM2-MoE and Qwen2 (the Qwen2.5 architecture) folders built
#   lfm2_provider     the LFM2 provider under TransformerEngine vs transformers, packed sequences,
#                     ten training steps (python -m slime_stoa.trainer.slime.lfm2.gpucheck)
#   worker_env        a Python with stoa's worker (MLX on the CPU, mlx-lm) for `macd run`
#   convert_lfm2_moe  `scripts/run_lfm2_search.sh --convert` on the tiny LFM2-MoE: slime's
#                     tools/convert_hf_to_torch_dist.py with stoa's LFM2 provider writes the
#                     Megatron torch_dist checkpoint the launch starts from (--ref-load)
#   e2e_lfm2_moe      `scripts/run_lfm2_search.sh` on it: the patch check, `stoa preflight`, Ray and
#                     slime's train.py as the recipe runs them, NUM_ROLLOUT rollouts from a real
#                     `macd run` worker on this box through a file:// bucket, a weight version
#                     published after each (current.json reaches v>=NUM_ROLLOUT); slime itself
#                     asserts at every training step that the trainer's logprobs of the worker's
#                     tokens are within GAP_LIMIT of the worker's (`--ci-test
#                     --ci-train-rollout-logprob-abs-diff-threshold`, on the mean |gap| per token
#                     that stoa's loss reports as train_rollout_logprob_abs_diff); the metric must
#                     be in the launch's tensorboard log (`--use-tensorboard`, TENSORBOARD_DIR), or
#                     the gate never ran and the check fails
#   convert_qwen2     `scripts/run_qwen25_gsm8k.sh --convert` on the tiny Qwen2 (its model args
#                     written from config.json as slime's scripts/models/qwen2.5-*.sh are)
#   e2e_qwen2         the same launch with slime's own Qwen2 model (no provider)
#   bits_lfm2_moe,    the published head equals the trainer's own weights bit for bit: the launch's
#   bits_qwen2        last Megatron checkpoint (Megatron's save, never touched by stoa's publisher)
#                     converted by slime's tools/convert_torch_dist_to_hf.py
#                     (python -m slime_stoa.trainer.slime.checkpoint_to_hf), against the head
#                     rebuilt from the bucket as a worker rebuilds it, every digest checked
#                     (python -m slime_stoa.trainer.slime.published_bits; report bits-FAMILY.json)
#
# The launches are the recipes themselves, with the tiny models' settings: nothing of their flags
# is restated here. Ray: the recipe starts a head when none answers at RAY_HEAD_IP (stopped here at
# exit); a launch past its time is stopped (`ray job stop`) before the next one starts.
# --dry-run prints every command (the recipes' own --dry-run output for theirs) and runs nothing.
#
# Settings (environment): SLIME_DIR (/root/slime), MEGATRON_DIR (/root/Megatron-LM), STOA_DIR (this
# checkout), WORK (a new temporary folder; must be new or empty; kept, logs inside), PYTHON
# (python3: slime's), WORKER_PYTHON (a Python with `stoa[worker]`; default: a venv made in WORK from
# STOA_DIR, which needs PyPI), NUM_ROLLOUT (3), BUDGET (seconds for all checks; default: the checks'
# caps added up, 2760 s with the defaults, 2400 s with WORKER_PYTHON, so that no check is cut short by
# the budget before its own cap; a smaller BUDGET can leave the last checks "not run"), CONVERT_TIMEOUT
# (150 s per conversion), E2E_TIMEOUT (240 s per launch), RAY_HEAD_IP (127.0.0.1),
# RAY_DASHBOARD_PORT (8265), GAP_LIMIT (0.5 nats per token: the quarantine's limit for a bf16
# worker, which the worker here serves, `--plane bf16`), SKIP_PREFLIGHT (0; 1: the launches skip
# the patch check and preflight). The recipes read their other settings (OPTIMIZER_OFFLOAD, RECOMPUTE,
# MAX_TOKENS_PER_GPU, LR, ...) from the environment as usual.
set -uo pipefail

PROG=${0##*/}
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
STOA_DIR=${STOA_DIR:-"$(dirname -- "$SCRIPT_DIR")"}
SLIME_DIR=${SLIME_DIR:-/root/slime}
MEGATRON_DIR=${MEGATRON_DIR:-/root/Megatron-LM}
PYTHON=${PYTHON:-python3}
WORKER_PYTHON=${WORKER_PYTHON:-}
NUM_ROLLOUT=${NUM_ROLLOUT:-3}
BUDGET=${BUDGET:-}  # default: CAPS_TOTAL (below)
CONVERT_TIMEOUT=${CONVERT_TIMEOUT:-150}
E2E_TIMEOUT=${E2E_TIMEOUT:-240}
RAY_HEAD_IP=${RAY_HEAD_IP:-127.0.0.1}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
SKIP_PREFLIGHT=${SKIP_PREFLIGHT:-0}
GAP_LIMIT=${GAP_LIMIT:-0.5}
GAP_METRIC=train/train_rollout_logprob_abs_diff  # stoa's loss reports it; slime's --ci-test gate asserts on it
GROUP_SIZE=4
ROLLOUT_BATCH_SIZE=4
MAX_TOKENS=32
SETUP_TIMEOUT=120  # each command that imports the GPU stack or builds models (gpu, imports, tiny_models, ...)
QUICK_TIMEOUT=60  # each small command (the patch, a run's set-up, the Qwen2 model args)
VENV_TIMEOUT=60 PIP_TIMEOUT=300  # the worker venv from PyPI (without WORKER_PYTHON)
CHECKS=(gpu imports patch tiny_models lfm2_provider worker_env convert_lfm2_moe e2e_lfm2_moe bits_lfm2_moe convert_qwen2
  e2e_qwen2 bits_qwen2)

DRY_RUN=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY_RUN=1 ;;
  -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "$PROG: error: unknown argument $1 (usage: $PROG [--dry-run])" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "$PROG: error: one argument at most (usage: $PROG [--dry-run])" >&2; exit 2; }
for n in NUM_ROLLOUT BUDGET CONVERT_TIMEOUT E2E_TIMEOUT; do
  [ "$n" = BUDGET ] && [ -z "$BUDGET" ] && continue
  [[ ${!n} =~ ^[1-9][0-9]*$ ]] || { echo "$PROG: error: $n must be a positive whole number, got '${!n}'" >&2; exit 2; }
done
[[ $GAP_LIMIT =~ ^[0-9]*\.?[0-9]+$ && ! $GAP_LIMIT =~ ^[0.]+$ ]] \
  || { echo "$PROG: error: GAP_LIMIT must be a positive number (nats per token), got '$GAP_LIMIT'" >&2; exit 2; }

if [ -z "${WORK:-}" ]; then
  if [ "$DRY_RUN" = 1 ]; then WORK="$(mktemp -u -d -t stoa-gpu-check.XXXXXX)"; else WORK="$(mktemp -d -t stoa-gpu-check.XXXXXX)"; fi
fi
WORK_PARENT="$(cd -- "$(dirname -- "$WORK")" 2>/dev/null && pwd)" \
  || { echo "$PROG: error: WORK=$WORK: its parent folder does not exist" >&2; exit 2; }
WORK="$WORK_PARENT/$(basename -- "$WORK")"
# A folder of an earlier check holds its checkpoints and published versions: a launch could pass on them.
if [ -d "$WORK" ] && [ -n "$(ls -A -- "$WORK")" ]; then
  echo "$PROG: error: WORK=$WORK is not empty: give a new or empty folder (an earlier check's checkpoints and versions would count)" >&2
  exit 2
fi

# Each check's cap: the caps of the commands it runs, added up (keep in step with the checks below).
# The default BUDGET is their sum, so the budget never cuts a check before its own cap does.
worker_env_cap=$SETUP_TIMEOUT
if [ -z "$WORKER_PYTHON" ]; then worker_env_cap=$((VENV_TIMEOUT + PIP_TIMEOUT + SETUP_TIMEOUT)); fi
e2e_cap=$((4 * QUICK_TIMEOUT + E2E_TIMEOUT))
bits_cap=$((SETUP_TIMEOUT + QUICK_TIMEOUT))
declare -A CAP=(
  [gpu]=$SETUP_TIMEOUT [imports]=$SETUP_TIMEOUT [patch]=$((2 * QUICK_TIMEOUT)) [tiny_models]=$SETUP_TIMEOUT
  [lfm2_provider]=$SETUP_TIMEOUT [worker_env]=$worker_env_cap [convert_lfm2_moe]=$CONVERT_TIMEOUT
  [e2e_lfm2_moe]=$e2e_cap [bits_lfm2_moe]=$bits_cap [convert_qwen2]=$((QUICK_TIMEOUT + CONVERT_TIMEOUT))
  [e2e_qwen2]=$e2e_cap [bits_qwen2]=$bits_cap
)
CAPS_TOTAL=0
CAPS_LIST=""
for check in "${CHECKS[@]}"; do
  CAPS_TOTAL=$((CAPS_TOTAL + CAP[$check]))
  CAPS_LIST="$CAPS_LIST${CAPS_LIST:+, }$check ${CAP[$check]}"
done
BUDGET=${BUDGET:-$CAPS_TOTAL}
TIME_PLAN="time budget BUDGET=${BUDGET} s; the checks' caps add up to ${CAPS_TOTAL} s ($CAPS_LIST)"
if [ "$BUDGET" -lt "$CAPS_TOTAL" ]; then
  TIME_PLAN="$TIME_PLAN; BUDGET is smaller: the last checks may be reported \"not run\""
fi

export PYTHONPATH="${MEGATRON_DIR}:${STOA_DIR}:${SLIME_DIR}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 MLX_DISABLE_COMPILE=1
FAILED=0
PASSED=" "  # the checks that passed, space-separated
REPORTED=0
WORKER_PIDS=()
RAY_WAS_UP=1
LAUNCHING=0  # 1 while a recipe's launch runs (its Ray job is stopped if this script ends then)

# -- running, printing and reporting ---------------------------------------------------------------
limited() {  # CAP COMMAND...: COMMAND under `timeout`, CAP seconds at most and no more than the budget left
  local cap=$1 left=$((BUDGET - SECONDS)) rc
  shift
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q' "$1"
    shift
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  if [ "$left" -lt "$cap" ]; then cap=$left; fi
  if [ "$cap" -le 0 ]; then
    echo "not run: the time budget (BUDGET=${BUDGET} s) is spent"
    return 124
  fi
  timeout -k 10 "$cap" "$@"
  rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "stopped after ${cap} s: $1 ran past its time"; fi
  return "$rc"
}

result() {  # NAME STATUS DETAIL
  REPORTED=$((REPORTED + 1))
  if [ "$2" = 0 ]; then
    PASSED="$PASSED$1 "
    printf 'PASS  %-17s %s\n' "$1" "$3"
  else
    printf 'FAIL  %-17s %s\n' "$1" "$3"
    FAILED=1
  fi
}

step() {  # NAME NEEDED LOG COMMAND...: run COMMAND with its output in LOG, report it; NEEDED: checks
  # (space-separated) that must have passed first, else it is a FAIL "not run"
  local name=$1 needed=$2 log=$3 start=$SECONDS rc
  shift 3
  if [ "$DRY_RUN" = 1 ]; then
    echo "# $name"
    "$@"
    return 0
  fi
  for need in $needed; do
    if [[ $PASSED != *" $need "* ]]; then
      result "$name" 1 "(not run: $need did not pass)"
      return 1
    fi
  done
  if [ $((BUDGET - SECONDS)) -le 0 ]; then
    result "$name" 1 "(not run: the time budget BUDGET=${BUDGET} s is spent)"
    return 1
  fi
  "$@" >"$log" 2>&1
  rc=$?
  result "$name" "$rc" "($((SECONDS - start)) s; log $log)"
  if [ "$rc" != 0 ]; then tail -n 15 "$log" | sed 's/^/      /'; fi
  return "$rc"
}

# -- the recipes, with the tiny models' settings ---------------------------------------------------
recipe_script() {  # FAMILY
  if [ "$1" = lfm2_moe ]; then echo "$SCRIPT_DIR/run_lfm2_search.sh"; else echo "$SCRIPT_DIR/run_qwen25_gsm8k.sh"; fi
}

rope_theta() {  # HF_DIR: its rope_theta, an integer (slime's --rotary-base)
  "$PYTHON" -c '
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
print(int((c.get("rope_parameters") or {}).get("rope_theta") or c["rope_theta"]))' "$1"
}

recipe() {  # CAP FAMILY ARGS...: the family's recipe with this check's settings (--dry-run in a dry run)
  local cap=$1 family=$2 rotary
  shift 2
  local settings=(
    STOA_DIR="$STOA_DIR" SLIME_DIR="$SLIME_DIR" MEGATRON_DIR="$MEGATRON_DIR" PYTHON="$PYTHON" STOA="$WORK/bin/stoa"
    STOA_STORE="file://$WORK/bucket-$family" STOA_RUN="gpucheck-$family" MODEL_DIR="$WORK/$family"
    REF_LOAD="$WORK/${family}_torch_dist" SAVE_DIR="$WORK/ckpt-$family" CONFIG_PATH="$WORK/ckpt-$family/stoa-config.yaml"
    NUM_GPUS=1 NUM_ROLLOUT="$NUM_ROLLOUT" ROLLOUT_BATCH_SIZE="$ROLLOUT_BATCH_SIZE" GROUP_SIZE="$GROUP_SIZE"
    GLOBAL_BATCH_SIZE=$((ROLLOUT_BATCH_SIZE * GROUP_SIZE)) TEMPERATURE=1.0 MAX_RESPONSE_LEN="$MAX_TOKENS"
    STALENESS_LIMIT= REUSE_LIMIT= WANDB_PROJECT= SKIP_PREFLIGHT="$SKIP_PREFLIGHT" TENSORBOARD_DIR="$WORK/tb-$family"
    RAY_HEAD_IP="$RAY_HEAD_IP" RAY_DASHBOARD_PORT="$RAY_DASHBOARD_PORT"
  )
  if [ "$family" = qwen2 ]; then
    if [ "$DRY_RUN" = 1 ]; then rotary="<rope_theta of $WORK/qwen2>"; else rotary=$(rope_theta "$WORK/qwen2") || return 1; fi
    settings+=(MODEL_ARGS_SCRIPT="$WORK/qwen2-model-args.sh" ROTARY_BASE="$rotary")
  fi
  if [ "$DRY_RUN" = 1 ]; then
    env "${settings[@]}" bash "$(recipe_script "$family")" --dry-run "$@"
  else
    limited "$cap" env "${settings[@]}" bash "$(recipe_script "$family")" "$@"
  fi
}

write_qwen2_model_args() {  # HF_DIR FILE: slime's model args for a Qwen2 folder, as slime's scripts/models/qwen2.5-*.sh
  # set them (--rotary-base is the recipe's ROTARY_BASE)
  limited "$QUICK_TIMEOUT" "$PYTHON" -c '
import json, shlex, sys
c = json.load(open(sys.argv[1] + "/config.json"))
flags = ["--swiglu", "--num-layers", c["num_hidden_layers"], "--hidden-size", c["hidden_size"],
         "--ffn-hidden-size", c["intermediate_size"], "--num-attention-heads", c["num_attention_heads"],
         "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias",
         "--normalization", "RMSNorm", "--norm-epsilon", c["rms_norm_eps"],
         "--group-query-attention", "--num-query-groups", c["num_key_value_heads"], "--vocab-size", c["vocab_size"]]
if not c.get("tie_word_embeddings", True):
    flags.append("--untie-embeddings-and-output-weights")
with open(sys.argv[2], "w") as f:
    f.write("MODEL_ARGS=(" + " ".join(shlex.quote(str(x)) for x in flags) + ")\n")' "$1" "$2"
}

convert() {  # FAMILY: the recipe's --convert; 0 when REF_LOAD holds a Megatron checkpoint after it
  local family=$1 ref="$WORK/${1}_torch_dist"
  if [ "$family" = qwen2 ]; then write_qwen2_model_args "$WORK/qwen2" "$WORK/qwen2-model-args.sh" || return 1; fi
  recipe "$CONVERT_TIMEOUT" "$family" --convert || return 1
  if [ "$DRY_RUN" = 1 ]; then return 0; fi
  [ -f "$ref/latest_checkpointed_iteration.txt" ] \
    || { echo "the converter exited 0 but wrote no $ref/latest_checkpointed_iteration.txt"; return 1; }
  echo "Megatron checkpoint: $ref ($(cat "$ref/latest_checkpointed_iteration.txt"))"
}

stop_jobs() {  # stop the Ray jobs of this check (their entrypoint names WORK) and wait for them to end,
  # whatever the budget left
  timeout -k 10 90 "$PYTHON" - "http://${RAY_HEAD_IP}:${RAY_DASHBOARD_PORT}" "$WORK" <<'PY'
import sys, time
from ray.job_submission import JobSubmissionClient
client = JobSubmissionClient(sys.argv[1])
mine = [j.submission_id for j in client.list_jobs()
        if sys.argv[2] in (j.entrypoint or "") and not j.status.is_terminal() and j.submission_id]
for job in mine:
    client.stop_job(job)
    print("stopped Ray job", job)
deadline = time.monotonic() + 60
while mine and time.monotonic() < deadline:
    mine = [job for job in mine if not client.get_job_status(job).is_terminal()]
    time.sleep(1)
sys.exit(1 if mine else 0)
PY
}

e2e() {  # FAMILY: seed a run, start a worker, launch the recipe; 0 when it published v>=NUM_ROLLOUT
  local family=$1 bucket="$WORK/bucket-$1" run="gpucheck-$1" url rc version
  url="file://$bucket"
  local stoa=("$WORK/bin/stoa")
  if [ "$DRY_RUN" = 0 ]; then mkdir -p "$bucket"; fi
  limited "$QUICK_TIMEOUT" "${stoa[@]}" run create --store "$url" --run "$run" --model "$WORK/$family" --task synthetic \
    --task-split train --temperature 1.0 --group-size "$GROUP_SIZE" --max-tokens "$MAX_TOKENS" --staleness-limit 4 \
    --reuse-limit 1 || return 1
  limited "$QUICK_TIMEOUT" "${stoa[@]}" task prepare synthetic --store "$url" --run "$run" --split train --count 256 || return 1
  limited "$QUICK_TIMEOUT" "${stoa[@]}" weights publish-anchor --store "$url" --run "$run" "$WORK/$family" || return 1
  limited "$QUICK_TIMEOUT" "$WORKER_PYTHON" -m macd join "$url" --run "$run" --name "gpucheck-${family//_/-}" \
    --worker-id "gpucheck-${family//_/-}" --config "$WORK/worker-$family/macd.toml" --data-dir "$WORK/worker-$family/data" \
    --plane bf16 --batch 8 --no-check || return 1
  # slime's own gate on the trainer-vs-worker gap (its KL check at step 0 expects no worker: off); it
  # asserts only when the metric reaches slime's log, so the metric is also written to tensorboard
  # (TENSORBOARD_DIR, set by `recipe`) and looked for there after the launch
  local gap=(-- --ci-test --ci-disable-kl-checker --ci-train-rollout-logprob-abs-diff-threshold "$GAP_LIMIT"
    --use-tensorboard)
  local worker_cmd=("$WORKER_PYTHON" -m macd run --config "$WORK/worker-$family/macd.toml" --seed 1 --parent-pid $$)
  if [ "$DRY_RUN" = 1 ]; then
    printf '%q ' "${worker_cmd[@]}"
    printf '&\n'
    recipe "$E2E_TIMEOUT" "$family" "${gap[@]}"
    return 0
  fi
  "${worker_cmd[@]}" >"$WORK/worker-$family/macd.log" 2>&1 &
  local worker=$!
  WORKER_PIDS+=("$worker")
  LAUNCHING=1
  recipe "$E2E_TIMEOUT" "$family" "${gap[@]}"
  rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then stop_jobs; fi
  LAUNCHING=0
  kill "$worker" 2>/dev/null
  [ "$rc" = 0 ] || { echo "the launch exited with $rc"; return 1; }
  version=$("$PYTHON" -c "import json,sys; print(int(json.load(open(sys.argv[1]))['version']))" "$bucket/runs/$run/current.json") \
    || { echo "no weight version published in $bucket"; return 1; }
  echo "published weight version: v$version (worker log: $WORK/worker-$family/macd.log)"
  [ "$version" -ge "$NUM_ROLLOUT" ] || { echo "v$version < NUM_ROLLOUT=$NUM_ROLLOUT"; return 1; }
  grep -a -q -r -- "$GAP_METRIC" "$WORK/tb-$family" 2>/dev/null \
    || { echo "slime logged no $GAP_METRIC (tensorboard: $WORK/tb-$family): its gap gate (--ci-test) never ran"; return 1; }
  echo "slime's gap gate ran: $GAP_METRIC within GAP_LIMIT=$GAP_LIMIT at every step (tensorboard: $WORK/tb-$family)"
}

bits() {  # FAMILY: the launch's last Megatron checkpoint, converted by slime's converter, is the
  # published head bit for bit (the recipe saves at its last rollout, then publishes that step)
  local family=$1 trainer_hf="$WORK/trainer-hf-$1"
  limited "$SETUP_TIMEOUT" "$PYTHON" -m slime_stoa.trainer.slime.checkpoint_to_hf --slime-dir "$SLIME_DIR" \
    --checkpoint "$WORK/ckpt-$family" --hf "$WORK/$family" --out "$trainer_hf" || return 1
  limited "$QUICK_TIMEOUT" "$PYTHON" -m slime_stoa.trainer.slime.published_bits --store "file://$WORK/bucket-$family" \
    --run "gpucheck-$family" --trainer-hf "$trainer_hf" --json "$WORK/bits-$family.json"
}

cleanup() {
  if [ "$LAUNCHING" = 1 ]; then stop_jobs; fi
  for pid in ${WORKER_PIDS[@]+"${WORKER_PIDS[@]}"}; do
    kill "$pid" 2>/dev/null
  done
  if [ "$RAY_WAS_UP" = 0 ] && ray status --address "${RAY_HEAD_IP}:6379" >/dev/null 2>&1; then
    ray stop >/dev/null 2>&1
  fi
}

patch_slime() {  # apply stoa's slime patch (idempotent), then check it as the recipes do
  limited "$QUICK_TIMEOUT" "$PYTHON" "$STOA_DIR/scripts/apply_slime_patches.py" "$SLIME_DIR" \
    && limited "$QUICK_TIMEOUT" "$PYTHON" "$STOA_DIR/scripts/apply_slime_patches.py" "$SLIME_DIR" --check
}

make_worker_env() {
  if [ -z "$WORKER_PYTHON" ]; then
    limited "$VENV_TIMEOUT" "$PYTHON" -m venv "$WORK/worker-venv" \
      && limited "$PIP_TIMEOUT" "$WORK/worker-venv/bin/python" -m pip install --quiet -e "${STOA_DIR}[worker]" || return 1
    WORKER_PYTHON="$WORK/worker-venv/bin/python"
  fi
  limited "$SETUP_TIMEOUT" "$WORKER_PYTHON" -c 'import mlx_lm, macd; print("mlx-lm", mlx_lm.__version__)'
}

# -- the checks ------------------------------------------------------------------------------------
if [ "$DRY_RUN" = 1 ]; then
  echo "# dry run: nothing is run or written; the checks' commands, in order (work folder $WORK); $TIME_PLAN"
  WORKER_PYTHON=${WORKER_PYTHON:-"$WORK/worker-venv/bin/python"}
else
  mkdir -p "$WORK/bin"
  printf '#!/usr/bin/env bash\nexec %q -m slime_stoa.cli "$@"\n' "$PYTHON" >"$WORK/bin/stoa"
  chmod +x "$WORK/bin/stoa"
  ray status --address "${RAY_HEAD_IP}:6379" >/dev/null 2>&1 || RAY_WAS_UP=0
  trap cleanup EXIT
  trap 'exit 130' INT TERM
  echo "stoa gpu check: work folder $WORK; $TIME_PLAN"
fi

step gpu "" "$WORK/gpu.log" limited "$SETUP_TIMEOUT" "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0))'

step imports "" "$WORK/imports.log" limited "$SETUP_TIMEOUT" "$PYTHON" -c '
import megatron.core, transformer_engine, slime, transformers
from transformers import AutoConfig
AutoConfig.for_model("lfm2_moe")
print("megatron-core", megatron.core.__version__, "transformers", transformers.__version__)'

step patch "" "$WORK/patch.log" patch_slime

step tiny_models "" "$WORK/tiny.log" limited "$SETUP_TIMEOUT" "$PYTHON" -c '
import sys
from slime_stoa.quickstart.tiny_model import build_tiny_family
for family in ("lfm2_moe", "qwen2"):
    print(build_tiny_family(sys.argv[1] + "/" + family, family))' "$WORK"

step lfm2_provider "gpu tiny_models" "$WORK/provider.log" limited "$SETUP_TIMEOUT" \
  "$PYTHON" -m slime_stoa.trainer.slime.lfm2.gpucheck --hf "$WORK/lfm2_moe" --json "$WORK/provider.json"

step worker_env "" "$WORK/worker_env.log" make_worker_env

for family in lfm2_moe qwen2; do
  step "convert_$family" "gpu tiny_models" "$WORK/convert-$family.log" convert "$family"
  step "e2e_$family" "worker_env convert_$family" "$WORK/e2e-$family.log" e2e "$family"
  step "bits_$family" "e2e_$family" "$WORK/bits-$family.log" bits "$family"
done

if [ "$DRY_RUN" = 1 ]; then exit 0; fi
passed=0
for check in "${CHECKS[@]}"; do
  if [[ $PASSED == *" $check "* ]]; then passed=$((passed + 1)); fi
done
if [ "$FAILED" = 0 ] && [ "$passed" = "${#CHECKS[@]}" ] && [ "$REPORTED" = "${#CHECKS[@]}" ]; then
  echo "all ${#CHECKS[@]} checks passed ($SECONDS s)"
  exit 0
fi
echo "$passed of ${#CHECKS[@]} checks passed ($SECONDS s; logs in $WORK)"
exit 1
