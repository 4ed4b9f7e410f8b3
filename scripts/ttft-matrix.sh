#!/usr/bin/env bash
# TTFT with offloading on versus off, over every shipped chain × workload × seed.
#
# Runs `kvtier run --json` (release build) on:
#   - every chain in config/ (default, cpu-only, cpu-disk-p2p, cpu-redis: the Redis chain gets a
#     redis-server this script starts on a free loopback port and stops again, one namespace per
#     run so no run sees another's chunks);
#   - small-cpu: a CPU tier smaller than the working set above the default disk tier (the
#     64 MiB of the 2000-request scenario this started from, scaled to the run's requests:
#     16 MiB for 400), so the disk tier serves hits;
#   - slow-disk: the same with every disk I/O delayed by 5 ms (the disk tier's
#     `inject_io_delay` option);
# × workloads chat, shared-prefix, scan × seeds 1..SEEDS, and prints one row per run: TTFT
# p50/p99 with offloading on and off (the same invocation runs both), tokens not recomputed (%
# of the baseline's prefill) and whether on > off. Disk slabs go to a temporary directory that
# is removed at the end, with the Redis server, also on failure or Ctrl-C.
#
# Settings (environment):
#   REQUESTS   requests per run (default 400; `kvtier run` defaults to 2000, fewer keeps the
#              whole matrix near 10 minutes on 2 cores)
#   SEEDS      seeds per cell (default 5)
#   CHAINS     chains to run, space separated (default: all six above)
#   WORKLOADS  workloads (default: chat shared-prefix scan)
#   SMALL_CPU  the CPU tier of small-cpu and slow-disk (default 16MiB)
#   RUN_ARGS   extra `kvtier run` arguments (default: --model llama-3.1-8b, which gives the
#              manager the engine's recompute cost; empty string for none)
#   KVTIER     the binary (default: builds target/release/kvtier)
#   OUT        also write the rows as TSV to this file
# Exit status: 0 when offload-on ≤ offload-off in every run (p50 and p99), 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=${REQUESTS:-400}
SEEDS=${SEEDS:-5}
CHAINS=${CHAINS:-"default cpu-only cpu-disk-p2p cpu-redis small-cpu slow-disk"}
WORKLOADS=${WORKLOADS:-"chat shared-prefix scan"}
RUN_ARGS=${RUN_ARGS---model llama-3.1-8b}
SMALL_CPU=${SMALL_CPU:-16MiB}

if [[ -z "${KVTIER:-}" ]]; then
  cargo build --release --quiet --bin kvtier
  KVTIER=target/release/kvtier
fi
command -v jq >/dev/null || { echo "ttft-matrix: jq is required" >&2; exit 2; }

WORK=$(mktemp -d -t kvtier-ttft-XXXXXX)
REDIS_PID=""
cleanup() {
  if [[ -n "$REDIS_PID" ]]; then
    kill "$REDIS_PID" 2>/dev/null || true
    wait "$REDIS_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

start_redis() {
  local port
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --maxmemory 2gb --maxmemory-policy allkeys-lru --dir "$WORK" >"$WORK/redis.log" 2>&1 &
  REDIS_PID=$!
  for _ in $(seq 100); do
    if redis-cli -p "$port" ping >/dev/null 2>&1; then
      REDIS_PORT=$port
      return 0
    fi
    sleep 0.05
  done
  echo "ttft-matrix: redis-server did not start (see $WORK/redis.log)" >&2
  cat "$WORK/redis.log" >&2
  exit 2
}

# Writes the chain file of `$1` for run `$2` into $WORK and prints its path. Disk slabs go
# under $WORK; the Redis namespace is unique per run.
chain_file() {
  local name=$1 run=$2 out="$WORK/$1-$2.toml" src
  case $name in
    small-cpu | slow-disk) src=config/default.toml ;;
    *) src=config/$name.toml ;;
  esac
  sed -e "s|^path = .*|path = \"$WORK/disk-$run\"|" \
    -e "s|^url = .*|url = \"redis://127.0.0.1:${REDIS_PORT:-6379}\"|" \
    -e "s|^namespace = .*|namespace = \"ttft-$run\"|" "$src" >"$out"
  case $name in
    small-cpu | slow-disk)
      # The primary's capacity is the first `capacity` line.
      sed -i "0,/^capacity = .*/s//capacity = \"$SMALL_CPU\"/" "$out"
      ;;
  esac
  if [[ $name == slow-disk ]]; then
    sed -i '/^name = "disk"/a inject_io_delay = "5ms"' "$out"
  fi
  echo "$out"
}

for c in $CHAINS; do
  if [[ $c == cpu-redis ]]; then
    start_redis
    break
  fi
done

echo "kvtier TTFT matrix: $REQUESTS requests per run (rate 300/s), seeds 1..$SEEDS, run args: ${RUN_ARGS:-(none)}, small-cpu/slow-disk CPU tier $SMALL_CPU"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-13s %-13s %4s | %9s %9s | %9s %9s | %7s %s\n' \
  chain workload seed "p50 on" "p50 off" "p99 on" "p99 off" "saved" ""
printf '%-13s %-13s %4s | %9s %9s | %9s %9s | %7s %s\n' "" "" "" ms ms ms ms "%" ""
[[ -n "${OUT:-}" ]] && printf 'chain\tworkload\tseed\tp50_on\tp50_off\tp99_on\tp99_off\tsaved_pct\tworse\n' >"$OUT"

runs=0
worse=0
max50=-1e9
max99=-1e9
start=$(date +%s)
for chain in $CHAINS; do
  for workload in $WORKLOADS; do
    for seed in $(seq "$SEEDS"); do
      runs=$((runs + 1))
      cfg=$(chain_file "$chain" "$runs")
      json="$WORK/report-$runs.json"
      # shellcheck disable=SC2086 # RUN_ARGS is a list of arguments
      if ! "$KVTIER" run --config "$cfg" --workload "$workload" --seed "$seed" \
        --requests "$REQUESTS" --json "$json" $RUN_ARGS >"$WORK/run.log" 2>&1; then
        echo "ttft-matrix: $chain $workload seed $seed failed:" >&2
        tail -20 "$WORK/run.log" >&2
        exit 2
      fi
      rm -rf "$WORK/disk-$runs"
      read -r p50 p50b p99 p99b saved < <(jq -r '[
          .ttft_ms.p50, .baseline.ttft_ms.p50, .ttft_ms.p99, .baseline.ttft_ms.p99,
          (if .baseline.computed_tokens > 0
             then 100 * .tokens_not_recomputed / .baseline.computed_tokens else 0 end)
        ] | map(tostring) | join(" ")' "$json")
      flag=$(awk -v a="$p50" -v b="$p50b" -v c="$p99" -v d="$p99b" 'BEGIN {
          s = ""; if (a > b) s = s "p50"; if (c > d) s = s (s == "" ? "" : ",") "p99"; print s }')
      [[ -n "$flag" ]] && worse=$((worse + 1))
      # The largest excess of on over off so far, in µs of simulated time.
      read -r max50 max99 < <(awk -v a="$p50" -v b="$p50b" -v c="$p99" -v d="$p99b" \
        -v m="$max50" -v n="$max99" 'BEGIN { x = (a - b) * 1000; y = (c - d) * 1000;
          printf "%s %s\n", (x > m ? x : m), (y > n ? y : n) }')
      printf '%-13s %-13s %4s | %9.3f %9.3f | %9.3f %9.3f | %7.1f %s\n' \
        "$chain" "$workload" "$seed" "$p50" "$p50b" "$p99" "$p99b" "$saved" "${flag:+ON>OFF $flag}"
      [[ -n "${OUT:-}" ]] && printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.2f\t%s\n' \
        "$chain" "$workload" "$seed" "$p50" "$p50b" "$p99" "$p99b" "$saved" "$flag" >>"$OUT"
    done
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg); $runs runs in $(($(date +%s) - start)) s"
echo "runs where offload-on TTFT exceeds offload-off (p50 or p99): $worse of $runs"
printf 'largest on − off over all runs: p50 %+.3f µs, p99 %+.3f µs (simulated clock)\n' "$max50" "$max99"
[[ $worse -eq 0 ]]
