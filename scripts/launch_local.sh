#!/usr/bin/env bash
# Starts N processes of examples/train_llama.py on this machine, joined by jax.distributed.
#
#   bash scripts/launch_local.sh [launcher options] N [train_llama.py args...]
#
#   bash scripts/launch_local.sh --cpu-devices 2 2 --preset tiny --steps 20 --mesh data=4   # 2 processes x 2 CPU devices
#   bash scripts/launch_local.sh --gpus-per-process 1 8 --preset 1b --mesh fsdp=8            # one process per GPU
#
# Each process i gets --coordinator localhost:PORT --num-processes N --process-id i (PORT: a
# free port, or --port). Process 0's stdout and stderr come as they are (it alone prints the
# progress bar and the summary); the others' output goes to stderr, each line prefixed "[i] "
# (their warnings and errors). The
# launcher waits for all of them; when one fails it stops the others (SIGTERM) and exits with
# the first failure's status (0 when all succeed).
#
# Launcher options (before N):
#   --cpu-devices K        each process gets K CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=K,
#                          JAX_PLATFORMS=cpu)
#   --gpus-per-process G   process i sees GPUs i*G .. i*G+G-1 (CUDA_VISIBLE_DEVICES; 1: one process per GPU).
#                          Without it every process sees every GPU and would claim them all: on a GPU machine
#                          pass it whenever N > 1
#   --port P               the coordinator's port (default: a free one)
#   --script PATH          another script taking the same flags (default: examples/train_llama.py)
#   --python PATH          the interpreter (default: $CODA_JAX_VENV/bin/python, else .venv/bin/python,
#                          as scripts/run.sh; create it with `bash scripts/run.sh train --help`)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}" >&2; exit 2; }
die() { echo "launch_local.sh: error: $*" >&2; exit 2; }
is_int() { [[ "$1" =~ ^[0-9]+$ ]]; }

cpu_devices="" gpus="" port="" script="$ROOT/examples/train_llama.py"
python="${CODA_JAX_VENV:-$ROOT/.venv}/bin/python"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-devices) [ $# -ge 2 ] && is_int "$2" && [ "$2" -ge 1 ] || die "--cpu-devices needs a count >= 1"
                   cpu_devices="$2"; shift 2 ;;
    --gpus-per-process) [ $# -ge 2 ] && is_int "$2" && [ "$2" -ge 1 ] || die "--gpus-per-process needs a count >= 1"
                   gpus="$2"; shift 2 ;;
    --port) [ $# -ge 2 ] && is_int "$2" && [ "$2" -ge 1 ] && [ "$2" -le 65535 ] || die "--port needs a port 1..65535"
            port="$2"; shift 2 ;;
    --script) [ $# -ge 2 ] || die "--script needs a path"; script="$2"; shift 2 ;;
    --python) [ $# -ge 2 ] || die "--python needs a path"; python="$2"; shift 2 ;;
    -h|--help) usage ;;
    --) shift; break ;;
    -*) die "unknown launcher option $1 (launcher options come before N; see --help)" ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage
n="$1"; shift
is_int "$n" && [ "$n" -ge 1 ] || die "N (the number of processes) must be an integer >= 1, got '$n'"
[ -n "$cpu_devices" ] && [ -n "$gpus" ] && die "--cpu-devices and --gpus-per-process exclude each other"
for a in "$@"; do
  case "$a" in
    --coordinator|--coordinator=*|--num-processes|--num-processes=*|--process-id|--process-id=*|--distributed)
      die "$a: the launcher passes --coordinator, --num-processes and --process-id itself" ;;
  esac
done
[ -x "$python" ] || die "no Python at $python (run 'bash scripts/run.sh train --help' once to create .venv, or pass --python)"
[ -f "$script" ] || die "no script at $script"

if [ -z "$port" ]; then
  # A port free now (the OS picks it); the coordinator binds it moments later.
  port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')" \
    || die "could not find a free port (pass --port)"
fi

tmp="$(mktemp -d)" || die "mktemp failed"
pids=()  # the train processes' ids, read back from $tmp/pid.I
stop_all() {  # the processes this launcher started, by their ids
  local i p
  for ((i = 0; i < n; i++)); do
    p="$(cat "$tmp/pid.$i" 2>/dev/null)" && [ -n "$p" ] && kill -TERM "$p" 2>/dev/null
  done
}
trap 'stop_all; rm -rf "$tmp"; exit 130' INT TERM
prefix() {  # each line as "[I] line" (portable: no GNU sed -u)
  local line
  while IFS= read -r line || [ -n "$line" ]; do printf '[%s] %s\n' "$1" "$line"; done
}

for ((i = 0; i < n; i++)); do
  env_args=(PYTHONUNBUFFERED=1)
  if [ -n "$cpu_devices" ]; then
    env_args+=(JAX_PLATFORMS=cpu "XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$cpu_devices")
  elif [ -n "$gpus" ]; then
    env_args+=("CUDA_VISIBLE_DEVICES=$(seq -s, $((i * gpus)) $((i * gpus + gpus - 1)))")
  fi
  run() {  # one process: its id and, when it ends, its exit status go to $tmp
    env "${env_args[@]}" "$python" "$script" "$@" --coordinator "localhost:$port" --num-processes "$n" \
      --process-id "$i" &
    echo $! > "$tmp/pid.$i.part" && mv "$tmp/pid.$i.part" "$tmp/pid.$i"  # renamed: never read half-written
    wait $!
    echo $? > "$tmp/rc.$i.part" && mv "$tmp/rc.$i.part" "$tmp/rc.$i"
  }
  if [ "$i" -eq 0 ]; then
    run "$@" &                                # process 0's stdout and stderr as they are (its progress bar)
  else
    run "$@" 2>&1 | prefix "$i" >&2 &         # the others': both, prefixed, to stderr
  fi
  pids+=($!)
done

# Poll for exit statuses; the first failure stops the others.
status=0 failed=""
while :; do
  finished=0
  for ((i = 0; i < n; i++)); do
    [ -f "$tmp/rc.$i" ] || continue
    finished=$((finished + 1))
    rc="$(cat "$tmp/rc.$i")"
    if [ "$rc" -ne 0 ] && [ -z "$failed" ]; then
      failed=$i status=$rc
      echo "launch_local.sh: process $i exited with status $rc; stopping the others" >&2
      stop_all
    fi
  done
  [ "$finished" -lt "$n" ] || break
  sleep 0.2
done
wait "${pids[@]}"  # the output filters finish printing
rm -rf "$tmp"
exit "$status"
