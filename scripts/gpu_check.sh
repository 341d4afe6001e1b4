#!/usr/bin/env bash
# gpu_check.sh: stoa's trainer on one CUDA GPU in slime's image, end to end, in under 10 minutes.
#
# Prints one PASS/FAIL line per check and exits 0 only when all pass:
#   gpu             torch sees a CUDA device
#   imports         megatron.core, transformer_engine, slime, and a transformers that knows lfm2_moe
#   patch           stoa's slime patch applied to SLIME_DIR (scripts/apply_slime_patches.py; idempotent)
#   tiny_models     tiny random LFM2-MoE and Qwen2 (the Qwen2.5 architecture) folders built
#   lfm2_provider   the LFM2 provider under TransformerEngine vs transformers, packed sequences,
#                   ten training steps (python -m slime_stoa.trainer.slime.lfm2.gpucheck)
#   worker_env      a Python with stoa's worker (MLX on the CPU, mlx-lm) for `macd run`
#   e2e_lfm2_moe    slime's train.py with the LFM2 provider (--custom-model-provider-path), the
#                   HF folder loaded through stoa's loader, NUM_ROLLOUT rollouts from a real
#                   `macd run` worker on this box through a file:// bucket, a weight version
#                   published after each (current.json reaches v>=NUM_ROLLOUT)
#   e2e_qwen2       the same with slime's own Qwen2 model (no provider)
#
# Slime runs in a Ray cluster of this box (started here when none answers `ray status`).
# Settings (environment): SLIME_DIR (/root/slime), MEGATRON_DIR (/root/Megatron-LM), STOA_DIR (this
# checkout), WORK (a new temporary folder; kept, logs inside), PYTHON (python3: slime's),
# WORKER_PYTHON (a Python with `stoa[worker]`; default: a venv made in WORK from STOA_DIR, which
# needs PyPI), NUM_ROLLOUT (3), E2E_TIMEOUT (240 s per run).
set -uo pipefail

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
STOA_DIR=${STOA_DIR:-"$(dirname -- "$SCRIPT_DIR")"}
SLIME_DIR=${SLIME_DIR:-/root/slime}
MEGATRON_DIR=${MEGATRON_DIR:-/root/Megatron-LM}
WORK=${WORK:-"$(mktemp -d -t stoa-gpu-check.XXXXXX)"}
PYTHON=${PYTHON:-python3}
WORKER_PYTHON=${WORKER_PYTHON:-}
NUM_ROLLOUT=${NUM_ROLLOUT:-3}
E2E_TIMEOUT=${E2E_TIMEOUT:-240}
GROUP_SIZE=4
ROLLOUT_BATCH_SIZE=4

export PYTHONPATH="${MEGATRON_DIR}:${STOA_DIR}:${SLIME_DIR}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 MLX_DISABLE_COMPILE=1
mkdir -p "$WORK"
FAILED=0
WORKER_PIDS=()

RAY_STARTED=0

cleanup() {
  for pid in ${WORKER_PIDS[@]+"${WORKER_PIDS[@]}"}; do
    kill "$pid" 2>/dev/null
  done
  if [ "$RAY_STARTED" = 1 ]; then ray stop >/dev/null 2>&1; fi
}
trap cleanup EXIT

result() {  # NAME STATUS DETAIL
  if [ "$2" = 0 ]; then
    printf 'PASS  %-15s %s\n' "$1" "$3"
  else
    printf 'FAIL  %-15s %s\n' "$1" "$3"
    FAILED=1
  fi
}

step() {  # NAME LOG COMMAND...: run COMMAND with its output in LOG, report it
  local name=$1 log=$2 start=$SECONDS rc
  shift 2
  "$@" >"$log" 2>&1
  rc=$?
  result "$name" "$rc" "($((SECONDS - start)) s; log $log)"
  if [ "$rc" != 0 ]; then tail -n 15 "$log" | sed 's/^/      /'; fi
  return "$rc"
}

echo "stoa gpu check: work folder $WORK"

step gpu "$WORK/gpu.log" "$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(0))'

step imports "$WORK/imports.log" "$PYTHON" -c '
import megatron.core, transformer_engine, slime, transformers
from transformers import AutoConfig
AutoConfig.for_model("lfm2_moe")
print("megatron-core", megatron.core.__version__, "transformers", transformers.__version__)'

step patch "$WORK/patch.log" bash -c "'$PYTHON' '$STOA_DIR/scripts/apply_slime_patches.py' '$SLIME_DIR' && '$PYTHON' '$STOA_DIR/scripts/apply_slime_patches.py' '$SLIME_DIR' --check"

step tiny_models "$WORK/tiny.log" "$PYTHON" -c "
from slime_stoa.quickstart.tiny_model import build_tiny_family
for family in ('lfm2_moe', 'qwen2'):
    print(build_tiny_family('$WORK/' + family, family))"

step lfm2_provider "$WORK/provider.log" "$PYTHON" -m slime_stoa.trainer.slime.lfm2.gpucheck --hf "$WORK/lfm2_moe" --json "$WORK/provider.json"

# -- the worker's Python ---------------------------------------------------------------------------
make_worker_env() {
  if [ -z "$WORKER_PYTHON" ]; then
    "$PYTHON" -m venv "$WORK/worker-venv" && "$WORK/worker-venv/bin/python" -m pip install --quiet -e "${STOA_DIR}[worker]" \
      || return 1
    WORKER_PYTHON="$WORK/worker-venv/bin/python"
  fi
  "$WORKER_PYTHON" -c 'import mlx_lm, macd; print("mlx-lm", mlx_lm.__version__)'
}
make_worker_env >"$WORK/worker_env.log" 2>&1
result worker_env $? "(${WORKER_PYTHON:-none}; log $WORK/worker_env.log)"

# -- slime + a real worker, end to end -------------------------------------------------------------
qwen2_flags() {  # slime's model flags for the tiny Qwen2 folder (as slime's scripts/models/qwen2.5-*.sh)
  "$PYTHON" - "$1" <<'PY'
import json, sys
c = json.load(open(sys.argv[1] + "/config.json"))
flags = ["--swiglu", "--num-layers", c["num_hidden_layers"], "--hidden-size", c["hidden_size"],
         "--ffn-hidden-size", c["intermediate_size"], "--num-attention-heads", c["num_attention_heads"],
         "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias",
         "--normalization", "RMSNorm", "--norm-epsilon", c["rms_norm_eps"], "--rotary-base", int(c["rope_theta"]),
         "--group-query-attention", "--num-query-groups", c["num_key_value_heads"], "--vocab-size", c["vocab_size"]]
if not c.get("tie_word_embeddings", True):
    flags.append("--untie-embeddings-and-output-weights")
print(" ".join(map(str, flags)))
PY
}

e2e() {  # FAMILY: seed a run, start a worker, train NUM_ROLLOUT rollouts; 0 when v>=NUM_ROLLOUT was published
  local family=$1 model="$WORK/$1" bucket="$WORK/bucket-$1" run="gpucheck-$1" url rc flags version
  url="file://$bucket"
  mkdir -p "$bucket"
  "$PYTHON" -m slime_stoa.cli run create --store "$url" --run "$run" --model "$model" --task synthetic \
    --task-split train --temperature 1.0 --group-size "$GROUP_SIZE" --max-tokens 32 --staleness-limit 4 \
    --reuse-limit 1 || return 1
  "$PYTHON" -m slime_stoa.cli task prepare synthetic --store "$url" --run "$run" --split train --count 256 || return 1
  "$PYTHON" -m slime_stoa.cli weights publish-anchor --store "$url" --run "$run" "$model" || return 1
  mkdir -p "$WORK/worker-$family"
  "$WORKER_PYTHON" -m macd join "$url" --run "$run" --name "gpucheck-$family" --worker-id "gpucheck-$family" \
    --config "$WORK/worker-$family/macd.toml" --data-dir "$WORK/worker-$family/data" --batch 8 --no-check || return 1
  "$WORKER_PYTHON" -m macd run --config "$WORK/worker-$family/macd.toml" --seed 1 --parent-pid $$ \
    >"$WORK/worker-$family/macd.log" 2>&1 &
  WORKER_PIDS+=($!)
  local worker=$!

  cat >"$WORK/stoa-$family.yaml" <<EOF
stoa_publish: true
stoa_bucket: "$url"
stoa_run: "$run"
stoa_prefetch_groups: $ROLLOUT_BATCH_SIZE
EOF
  if [ "$family" = lfm2_moe ]; then
    flags=$("$PYTHON" -m slime_stoa.trainer.slime.lfm2.flags "$model") || return 1
    flags="$flags --custom-model-provider-path slime_stoa.trainer.slime.lfm2.spec.provider --moe-grouped-gemm"
  else
    flags=$(qwen2_flags "$model") || return 1
  fi
  # shellcheck disable=SC2086  # the model flags are one word each
  timeout "$E2E_TIMEOUT" "$PYTHON" "$SLIME_DIR/train.py" \
    --actor-num-nodes 1 --actor-num-gpus-per-node 1 \
    $flags \
    --hf-checkpoint "$model" --ref-load "$model" --load "$WORK/ckpt-$family" \
    --rollout-num-gpus 0 --rollout-function-path slime_stoa.generate_rollout \
    --data-source-path slime_stoa.StoaDataSource \
    --num-rollout "$NUM_ROLLOUT" --rollout-batch-size "$ROLLOUT_BATCH_SIZE" --n-samples-per-prompt "$GROUP_SIZE" \
    --rollout-temperature 1.0 --rollout-top-p 1.0 --rollout-max-response-len 32 \
    --global-batch-size $((ROLLOUT_BATCH_SIZE * GROUP_SIZE)) \
    --advantage-estimator grpo --loss-type custom_loss --custom-loss-function-path slime_stoa.dppo_loss \
    --use-rollout-logprobs --calculate-per-token-loss --entropy-coef 0.0 \
    --optimizer adam --lr 1e-5 --lr-decay-style constant \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1 \
    --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 \
    --use-dynamic-batch-size --max-tokens-per-gpu 4096 \
    --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 \
    --attention-softmax-in-fp32 --attention-backend flash \
    --custom-config-path "$WORK/stoa-$family.yaml"
  rc=$?
  kill "$worker" 2>/dev/null
  [ "$rc" = 0 ] || { echo "slime exited with $rc"; return 1; }
  version=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['version'])" "$bucket/runs/$run/current.json") \
    || return 1
  echo "published weight version: v$version (worker log: $WORK/worker-$family/macd.log)"
  [ "$version" -ge "$NUM_ROLLOUT" ]
}

# slime's train.py joins the local Ray cluster; one is started here (and stopped at exit) if none runs.
if ! ray status >/dev/null 2>&1; then
  ray start --head --num-gpus 1 --disable-usage-stats >"$WORK/ray.log" 2>&1 && RAY_STARTED=1
fi

for family in lfm2_moe qwen2; do
  if [ -z "$WORKER_PYTHON" ]; then
    result "e2e_$family" 1 "(no worker Python: see worker_env)"
    continue
  fi
  step "e2e_$family" "$WORK/e2e-$family.log" e2e "$family"
done

if [ "$FAILED" = 0 ]; then
  echo "all checks passed"
else
  echo "some checks failed (logs in $WORK)"
fi
exit "$FAILED"
