#!/usr/bin/env bash
# provision_fleet.sh: install stoa's rollout daemon (macd) on a list of Macs over SSH.
#
# For each host: create a venv, pip install stoa's wheel (or --package), `macd join` the run, `macd install`,
# `macd start`. Re-running it is safe: the venv is reused, the package upgraded, and `macd join`
# keeps each Mac's worker id.
#
# Signed runs: --run-key pins the run key on every Mac (`macd join --run-key`), and --key (the run
# key file, kept on this machine) issues one worker key per host here (`stoa worker add`, kept
# 0600 under --worker-keys and reused on a re-run), copies it to the Mac and installs it
# (`macd join --worker-key`, which keeps its own 0600 copy; the copied file is then removed).
# Without a worker key a Mac's records are refused by the trainer of a signed run.
#
# Secrets: the bucket credentials are taken from this shell's environment (STOA_ACCESS_KEY_ID /
# STOA_SECRET_ACCESS_KEY, else AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, plus AWS_SESSION_TOKEN)
# or from --credentials-file, and sent on ssh's stdin to `macd join --credentials-stdin`, which
# writes them to a 0600 file on the Mac. They never appear on a command line, here or remotely,
# so `ps` on either machine cannot show them (printf is a shell builtin: no process carries
# them as arguments). Without credentials, each Mac must already have its own (~/.r2env, ...).
#
# SSH runs with BatchMode (no password prompts): set up keys first (ssh-copy-id). Options
# such as ports or jump hosts belong in ~/.ssh/config. Written for bash 3.2 (macOS) and later.
set -euo pipefail

PROG=${0##*/}
SSH_OPTS=(-o BatchMode=yes -o ConnectTimeout=20)

usage() {
  cat <<EOF
usage: $PROG --bucket URL --run RUN [options] HOSTS_FILE

Install stoa's rollout daemon on the Macs listed in HOSTS_FILE, over SSH.

HOSTS_FILE: one Mac per line, "user@host [name]" (name: the worker's label in the fleet table,
default the Mac's host name); blank lines and lines starting with # are ignored.

required:
  --bucket URL              bucket of the run (r2://account/bucket/prefix, s3://..., file://...)
  --run RUN                 run name (created with \`stoa run create\`)

options:
  --wheel PATH              copy this local wheel to each Mac and install it (with [worker]);
                            build it from a checkout: pip wheel --no-deps -w dist .
  --package SPEC            or: what to pip install instead, e.g. "slime-stoa[worker]" once
                            published, or "git+https://...#egg=slime-stoa[worker]"
  (one of --wheel and --package is required)
  --python PYTHON           Python 3.11+ on the Macs to make the venv with (default: python3)
  --remote-dir DIR          folder on each Mac, relative to its home (default: .stoa)
  --credentials-file FILE   env file with AWS_ACCESS_KEY_ID=/AWS_SECRET_ACCESS_KEY= lines
                            (default: those variables in this shell's environment)
  --run-key TEXT            pin this run key (ed25519:..., \`stoa keys show RUN_KEY_FILE\`) on
                            every Mac (default with --key: that key's public half)
  --key RUN_KEY_FILE        issue a worker key per host with this run key (\`stoa worker add\`,
                            run here) and install it on the Mac
  --worker-keys DIR         where the issued worker keys are kept, one per host, reused when
                            the script runs again (default: worker-keys-RUN)
  --stoa PATH               the stoa command used here for --key (default: stoa)
  --parallel N              provision N Macs at a time (default: 1)
  --dry-run                 print the commands for each host and exit; contacts nothing
  -h, --help                show this help
EOF
}

usage_error() {
  echo "$PROG: error: $1" >&2
  echo "run \`$PROG --help\` for usage" >&2
  exit 2
}

fail() {
  echo "$PROG: error: $1" >&2
  exit 1
}

# shq ARG: ARG quoted for a POSIX shell (bare when safe, else in single quotes).
shq() {
  case $1 in
    '') printf "''" ;;
    *[!A-Za-z0-9_./:=@%+,-]*) printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")" ;;
    *) printf '%s' "$1" ;;
  esac
}

# shjoin ARGS...: the arguments as one shell command line.
shjoin() {
  local out="" arg
  for arg in "$@"; do
    out="$out${out:+ }$(shq "$arg")"
  done
  printf '%s' "$out"
}

# -- arguments --------------------------------------------------------------------------------

BUCKET="" RUN="" PACKAGE="" WHEEL="" PYTHON="python3" REMOTE_DIR=".stoa"
CRED_FILE="" PARALLEL=1 DRY_RUN=0 HOSTS_FILE=""
RUN_KEY="" KEY_FILE="" KEYS_DIR="" STOA=stoa

need_value() {
  [ $# -ge 2 ] && [ -n "$2" ] || usage_error "$1 needs a value"
}

[ $# -gt 0 ] || { usage >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) usage; exit 0 ;;
    --bucket) need_value "$@"; BUCKET=$2; shift 2 ;;
    --run) need_value "$@"; RUN=$2; shift 2 ;;
    --package) need_value "$@"; PACKAGE=$2; shift 2 ;;
    --wheel) need_value "$@"; WHEEL=$2; shift 2 ;;
    --python) need_value "$@"; PYTHON=$2; shift 2 ;;
    --remote-dir) need_value "$@"; REMOTE_DIR=$2; shift 2 ;;
    --credentials-file) need_value "$@"; CRED_FILE=$2; shift 2 ;;
    --parallel) need_value "$@"; PARALLEL=$2; shift 2 ;;
    --run-key) need_value "$@"; RUN_KEY=$2; shift 2 ;;
    --key) need_value "$@"; KEY_FILE=$2; shift 2 ;;
    --worker-keys) need_value "$@"; KEYS_DIR=$2; shift 2 ;;
    --stoa) need_value "$@"; STOA=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; break ;;
    -*) usage_error "unknown option $1" ;;
    *) [ -z "$HOSTS_FILE" ] || usage_error "more than one hosts file ($HOSTS_FILE, $1)"; HOSTS_FILE=$1; shift ;;
  esac
done
if [ $# -gt 0 ]; then
  [ -z "$HOSTS_FILE" ] && [ $# -eq 1 ] || usage_error "unexpected arguments: $*"
  HOSTS_FILE=$1
fi

[ -n "$HOSTS_FILE" ] || usage_error "no hosts file given"
[ -n "$BUCKET" ] || usage_error "--bucket URL is required"
[ -n "$RUN" ] || usage_error "--run RUN is required"
[ -n "$WHEEL" ] || [ -n "$PACKAGE" ] || usage_error "say what to install: --wheel PATH (build one with \`pip wheel --no-deps -w dist .\` in a stoa checkout) or --package SPEC"
[ -z "$WHEEL" ] || [ -z "$PACKAGE" ] || usage_error "--wheel and --package exclude each other"
case $PARALLEL in ''|*[!0-9]*|0) usage_error "--parallel needs a positive integer, got '$PARALLEL'" ;; esac
case $REMOTE_DIR in /*|\~*|*..*) usage_error "--remote-dir must be relative to the remote home, without '..'" ;; esac
[ -f "$HOSTS_FILE" ] || fail "hosts file $HOSTS_FILE does not exist (expected lines \"user@host [name]\")"
[ -r "$HOSTS_FILE" ] || fail "hosts file $HOSTS_FILE is not readable"
if [ -n "$WHEEL" ]; then
  [ -f "$WHEEL" ] || fail "wheel $WHEEL does not exist"
  case $WHEEL in *.whl) ;; *) fail "--wheel expects a .whl file, got $WHEEL" ;; esac
fi
if [ -n "$CRED_FILE" ]; then
  [ -r "$CRED_FILE" ] || fail "credentials file $CRED_FILE does not exist or is not readable"
fi
case $RUN_KEY in ''|ed25519:*) ;; *) usage_error "--run-key expects a public key ed25519:... (\`stoa keys show RUN_KEY_FILE\`), got '$RUN_KEY'" ;; esac
[ -z "$KEYS_DIR" ] || [ -n "$KEY_FILE" ] || usage_error "--worker-keys needs --key RUN_KEY_FILE (the key that issues them)"
if [ -n "$KEY_FILE" ]; then
  [ -r "$KEY_FILE" ] || fail "run key file $KEY_FILE does not exist or is not readable"
  KEYS_DIR=${KEYS_DIR:-worker-keys-$RUN}
  if [ -z "$RUN_KEY" ]; then  # pin the key that signs the run: its public half
    RUN_KEY=$("$STOA" keys show "$KEY_FILE" 2>/dev/null | awk '$1 == "public" && $2 == "key" { print $3; exit }') || true
    case $RUN_KEY in
      ed25519:*) ;;
      *) fail "could not read the public key of $KEY_FILE with \`$STOA keys show\`: pass --stoa PATH, or --run-key TEXT" ;;
    esac
  fi
fi

# -- hosts ------------------------------------------------------------------------------------

TARGETS=() NAMES=()
line_no=0
while IFS= read -r line || [ -n "$line" ]; do
  line_no=$((line_no + 1))
  line=${line%%#*}  # comments, whole-line or trailing
  target="" name="" extra=""
  read -r target name extra <<<"$line" || true
  [ -n "$target" ] || continue
  [ -z "$extra" ] || fail "$HOSTS_FILE line $line_no: expected \"user@host [name]\", got extra words: $extra"
  case $target in -*|*[!A-Za-z0-9@._:-]*) fail "$HOSTS_FILE line $line_no: invalid ssh target '$target'" ;; esac
  case $name in -*) fail "$HOSTS_FILE line $line_no: a name may not start with '-'" ;; esac
  TARGETS+=("$target")
  NAMES+=("$name")
done <"$HOSTS_FILE"
[ ${#TARGETS[@]} -gt 0 ] || fail "no hosts in $HOSTS_FILE (expected lines \"user@host [name]\")"

# -- credentials ------------------------------------------------------------------------------

# Names of the variables holding the credentials (never their values).
KEY_VAR="" SECRET_VAR="" TOKEN_VAR=""
if [ -z "$CRED_FILE" ]; then
  if [ -n "${STOA_ACCESS_KEY_ID:-}" ] && [ -n "${STOA_SECRET_ACCESS_KEY:-}" ]; then
    KEY_VAR=STOA_ACCESS_KEY_ID SECRET_VAR=STOA_SECRET_ACCESS_KEY
  elif [ -n "${AWS_ACCESS_KEY_ID:-}" ] && [ -n "${AWS_SECRET_ACCESS_KEY:-}" ]; then
    KEY_VAR=AWS_ACCESS_KEY_ID SECRET_VAR=AWS_SECRET_ACCESS_KEY
    [ -z "${AWS_SESSION_TOKEN:-}" ] || TOKEN_VAR=AWS_SESSION_TOKEN
  fi
fi
HAVE_CREDS=0
if [ -n "$CRED_FILE" ] || [ -n "$KEY_VAR" ]; then HAVE_CREDS=1; fi
case $BUCKET in
  file://*) HAVE_CREDS=0 ;;  # a local folder needs none
  *) [ "$HAVE_CREDS" = 1 ] || echo "$PROG: warning: no credentials in the environment or --credentials-file;" \
       "each Mac must already have its own (~/.r2env, ~/.config/stoa/credentials.env)" >&2 ;;
esac

# send_credentials: the credentials as env-file lines on stdout (printf is a builtin).
send_credentials() {
  if [ -n "$CRED_FILE" ]; then
    cat -- "$CRED_FILE"
  else
    printf 'AWS_ACCESS_KEY_ID=%s\nAWS_SECRET_ACCESS_KEY=%s\n' "${!KEY_VAR}" "${!SECRET_VAR}"
    [ -z "$TOKEN_VAR" ] || printf 'AWS_SESSION_TOKEN=%s\n' "${!TOKEN_VAR}"
  fi
}

# How the dry run shows that pipe: variable names or the file, never values.
credentials_source_text() {
  if [ -n "$CRED_FILE" ]; then
    printf '< %s' "$(shq "$CRED_FILE")"
  else
    local fmt='AWS_ACCESS_KEY_ID=%s\nAWS_SECRET_ACCESS_KEY=%s\n' vars="\"\$$KEY_VAR\" \"\$$SECRET_VAR\""
    [ -z "$TOKEN_VAR" ] || { fmt="${fmt}AWS_SESSION_TOKEN=%s\\n"; vars="$vars \"\$$TOKEN_VAR\""; }
    printf "printf '%s' %s |" "$fmt" "$vars"
  fi
}

# -- the steps for one host ---------------------------------------------------------------------

VENV="$REMOTE_DIR/venv"
REMOTE_WORKER_KEY="$REMOTE_DIR/worker-key.json"  # the copied worker key, until macd join installs it

worker_key_file() {  # TARGET: the issued worker key of a host, on this machine
  printf '%s/%s.worker-key' "$KEYS_DIR" "$(printf '%s' "$1" | tr -c 'A-Za-z0-9._-' '_')"
}

worker_name() {  # TARGET NAME: the worker's display name (the hosts file's, else the host name)
  if [ -n "$2" ]; then printf '%s' "$2"; else local host=${1#*@}; printf '%s' "${host%%:*}"; fi
}

# local_issue_cmd TARGET NAME: issue the host's worker key here, unless it was issued before.
local_issue_cmd() {
  local file argv
  file=$(worker_key_file "$1")
  argv=("$STOA" worker add "$(worker_name "$1" "$2")" --store "$BUCKET" --run "$RUN" --key "$KEY_FILE" --out "$file")
  printf 'test -e %s || %s%s' "$(shq "$file")" "${CRED_FILE:+STOA_ENV_FILE=$(shq "$CRED_FILE") }" "$(shjoin "${argv[@]}")"
}
PY_CHECK='import sys; sys.exit(sys.version_info < (3, 11) and "stoa needs Python 3.11+: pass --python PATH")'

remote_venv_cmd() {
  printf '%s && %s && %s' "$(shjoin mkdir -p "$REMOTE_DIR")" "$(shjoin "$PYTHON" -c "$PY_CHECK")" \
    "$(shjoin "$PYTHON" -m venv "$VENV")"
}

remote_pip_cmd() {
  local spec=$PACKAGE
  [ -z "$WHEEL" ] || spec="$REMOTE_DIR/${WHEEL##*/}[worker]"
  printf '%s && %s' "$(shjoin "$VENV/bin/python" -m pip install --quiet --upgrade pip)" \
    "$(shjoin "$VENV/bin/python" -m pip install --upgrade "$spec")"
}

remote_join_cmd() {  # NAME
  local argv=("$VENV/bin/macd" join "$BUCKET" --run "$RUN")
  [ -z "$1" ] || argv+=(--name "$1")
  [ "$HAVE_CREDS" = 0 ] || argv+=(--credentials-stdin)
  [ -z "$RUN_KEY" ] || argv+=(--run-key "$RUN_KEY")
  if [ -n "$KEY_FILE" ]; then
    argv+=(--worker-key "$REMOTE_WORKER_KEY")
    printf '%s && %s' "$(shjoin "${argv[@]}")" "$(shjoin rm -f "$REMOTE_WORKER_KEY")"
  else
    shjoin "${argv[@]}"
  fi
}

# step_lines TARGET NAME: one line per step, "label<TAB>kind<TAB>command" (kind: local, run here;
# ssh; scp, the wheel; scpkey, the worker key; join).
step_lines() {
  local target=$1 name=$2
  [ -z "$KEY_FILE" ] || printf 'worker key\tlocal\t%s\n' "$(local_issue_cmd "$target" "$name")"
  printf 'venv\tssh\t%s\n' "$(remote_venv_cmd)"
  [ -z "$WHEEL" ] || printf 'copy wheel\tscp\t%s\n' "$REMOTE_DIR/"
  [ -z "$KEY_FILE" ] || printf 'copy worker key\tscpkey\t%s\n' "$REMOTE_WORKER_KEY"
  printf 'pip install\tssh\t%s\n' "$(remote_pip_cmd)"
  printf 'macd join\tjoin\t%s\n' "$(remote_join_cmd "$name")"
  printf 'macd install\tssh\t%s\n' "$(shjoin "$VENV/bin/macd" install)"
  printf 'macd start\tssh\t%s\n' "$(shjoin "$VENV/bin/macd" start)"
}

# step_argv TARGET KIND CMD: sets ARGV to the local command of a step.
step_argv() {
  case $2 in
    local) ARGV=(bash -c "$3") ;;
    scp) ARGV=(scp -q "${SSH_OPTS[@]}" "$WHEEL" "$1:$3") ;;
    scpkey) ARGV=(scp -q "${SSH_OPTS[@]}" "$(worker_key_file "$1")" "$1:$3") ;;
    *) ARGV=(ssh "${SSH_OPTS[@]}" "$1" "$3") ;;
  esac
}

# print_step TARGET KIND CMD: the exact command line of a step, stdin included.
print_step() {
  step_argv "$@"
  if [ "$2" = local ]; then
    printf '%s\n' "$3"
  elif [ "$2" = join ] && [ "$HAVE_CREDS" = 1 ] && [ -z "$CRED_FILE" ]; then
    printf '%s %s\n' "$(credentials_source_text)" "$(shjoin "${ARGV[@]}")"
  elif [ "$2" = join ] && [ "$HAVE_CREDS" = 1 ]; then
    printf '%s %s\n' "$(shjoin "${ARGV[@]}")" "$(credentials_source_text)"
  else
    printf '%s < /dev/null\n' "$(shjoin "${ARGV[@]}")"
  fi
}

# run_step TARGET KIND CMD
run_step() {
  step_argv "$@"
  if [ "$2" = join ] && [ "$HAVE_CREDS" = 1 ]; then
    send_credentials | "${ARGV[@]}"
  else
    "${ARGV[@]}" </dev/null
  fi
}

host_label() {  # INDEX
  local name=${NAMES[$1]}
  printf '%s%s' "${TARGETS[$1]}" "${name:+ ($name)}"
}

# provision INDEX STATUS_FILE: run every step on one host; records "ok" or the failed step.
provision() {
  local i=$1 status_file=$2 target=${TARGETS[$1]} step kind cmd
  while IFS="$(printf '\t')" read -r step kind cmd; do
    echo "-- $step"
    if ! run_step "$target" "$kind" "$cmd"; then
      echo "FAILED: $step" >"$status_file"
      echo "-- $step FAILED"
      return 1
    fi
  done < <(step_lines "$target" "${NAMES[$i]}")
  echo ok >"$status_file"
  echo "-- done"
}

prefix_lines() {  # LABEL
  local line
  while IFS= read -r line || [ -n "$line" ]; do
    printf '[%s] %s\n' "$1" "$line"
  done
}

# -- main -------------------------------------------------------------------------------------

if [ "$DRY_RUN" = 1 ]; then
  for i in "${!TARGETS[@]}"; do
    echo "# $(host_label "$i")"
    while IFS="$(printf '\t')" read -r step kind cmd; do
      print_step "${TARGETS[$i]}" "$kind" "$cmd"
    done < <(step_lines "${TARGETS[$i]}" "${NAMES[$i]}")
    echo
  done
  echo "# dry run: ${#TARGETS[@]} host(s), nothing was contacted"
  exit 0
fi

if [ -n "$KEY_FILE" ]; then
  mkdir -p "$KEYS_DIR" && chmod 700 "$KEYS_DIR" || fail "cannot create the worker key folder $KEYS_DIR"
fi
STATUS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/provision_fleet.XXXXXX")
trap 'rm -rf "$STATUS_DIR"' EXIT
PIDS=()
for i in "${!TARGETS[@]}"; do
  if [ ${#PIDS[@]} -ge "$PARALLEL" ]; then  # wait for the oldest job to free a slot
    wait "${PIDS[0]}" || true
    PIDS=(${PIDS[@]+"${PIDS[@]:1}"})
  fi
  label=${NAMES[$i]:-${TARGETS[$i]}}
  { provision "$i" "$STATUS_DIR/$i" 2>&1 | prefix_lines "$label"; } &
  PIDS+=($!)
done
for pid in ${PIDS[@]+"${PIDS[@]}"}; do
  wait "$pid" || true
done

ok=0 failed=0 report=""
for i in "${!TARGETS[@]}"; do
  result=$(cat "$STATUS_DIR/$i" 2>/dev/null || echo "FAILED: did not finish")
  if [ "$result" = ok ]; then
    ok=$((ok + 1))
    report="$report$(printf 'ok      %s' "$(host_label "$i")")"$'\n'
  else
    failed=$((failed + 1))
    report="$report$(printf 'FAILED  %s: %s' "$(host_label "$i")" "${result#FAILED: }")"$'\n'
  fi
done
echo
echo "summary: $ok ok, $failed failed"
printf '%s' "$report"
[ "$failed" -eq 0 ]
