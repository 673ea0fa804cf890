#!/usr/bin/env bash
# Run a list of GPU bench commands in one device call and bring every result back as ONE file.
#
#   bash bench/run_list.sh bench/rounds/NAME.txt [SECONDS_LEFT]
#
# Each non-empty, non-# line of the list is one command, run from the repository root with
# `timeout` (a line may start with `T=SECONDS ` to set its own limit; default 240 s) and
# `R=$OUT/r` in its environment (benches write their JSON/markdown there with `--out $R`). A
# command that fails or times out is logged and the list goes on. Commands are skipped once less
# than their limit is left of SECONDS_LEFT (default 540: a device call may run 600 s). At the end,
# whatever happened, $R (logs included) is packed into $OUT/results.tgz: the device tool returns
# at most 8 files per call, so benches that write many files would otherwise lose some.
set -uo pipefail
list=${1:?usage: bench/run_list.sh LIST [SECONDS_LEFT]}
budget=${2:-540}
OUT=${OUT:-.out/run_list}
R=$OUT/r
export R
mkdir -p "$R"
start=$(date +%s)
pack() { tar -C "$OUT" -czf "$OUT/results.tgz" r && rm -rf "$R"; }
trap pack EXIT
n=0
while IFS= read -r line || [ -n "$line" ]; do
  [[ -z "${line// }" || "$line" =~ ^[[:space:]]*# ]] && continue
  n=$((n + 1))
  limit=240
  if [[ "$line" =~ ^T=([0-9]+)[[:space:]]+(.*)$ ]]; then
    limit=${BASH_REMATCH[1]}
    line=${BASH_REMATCH[2]}
  fi
  used=$(($(date +%s) - start))
  if ((used + limit > budget)); then
    echo "[$n] skipped (${used}s used, needs up to ${limit}s): $line" | tee -a "$R/skipped.log"
    continue
  fi
  echo "[$n] ${used}s: $line"
  t0=$(date +%s)
  timeout "$limit" bash -c "$line" >"$R/$n.log" 2>&1
  rc=$?
  echo "[$n] rc=$rc in $(($(date +%s) - t0))s"
  tail -n "${TAIL:-12}" "$R/$n.log" | cut -c1-240
done <"$list"
