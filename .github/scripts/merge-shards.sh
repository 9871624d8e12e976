#!/usr/bin/env bash
# Join the bench shards of one machine kind, as the merge job of gpu.yml and cpu.yml does.
#
#   merge-shards.sh SHARDS_DIR N [RESULTS_ROOT]
#
# SHARDS_DIR holds one folder per shard (what actions/download-artifact writes), each
# a copy of results/<machine>/ from its runner: the shard's run-*-shard<i>of<N>.json
# and the timing caches it used and extended. Writes RESULTS_ROOT/<machine>/run-<ts>.json
# (the merged run: `harness merge` checks that the shards share machine, commit and
# settings) and merges every shard's cache into RESULTS_ROOT/<machine>/caches/ (the
# committed cache wins a conflict; keys a shard timed are added). Appends
# HARNESS_MACHINE_ID and HARNESS_MERGED_RUN to $GITHUB_ENV when it is set, so the
# gate step gates the merged run of this kind. Exits non-zero, naming what is
# missing, unless all N shards are there.
set -euo pipefail
shards_dir=${1:?usage: merge-shards.sh SHARDS_DIR N [RESULTS_ROOT]}
expected=${2:?usage: merge-shards.sh SHARDS_DIR N [RESULTS_ROOT]}
root=${3:-results}
harness=${HARNESS:-harness}

mapfile -t runs < <(find "$shards_dir" -name "run-*-shard*of${expected}.json" | sort)
if [ "${#runs[@]}" -ne "$expected" ]; then
  echo "error: ${#runs[@]} of $expected shard results found under $shards_dir:" >&2
  printf '  %s\n' "${runs[@]}" >&2
  echo "a shard job failed or was cancelled: its cases would be missing from the gate" >&2
  exit 1
fi
for i in $(seq 1 "$expected"); do
  found=0
  for run in "${runs[@]}"; do
    if [[ $run == *"-shard${i}of${expected}.json" ]]; then found=1; fi
  done
  if [ "$found" -eq 0 ]; then
    echo "error: shard $i/$expected is missing under $shards_dir" >&2
    exit 1
  fi
done

machine=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["machine"]["id"])' "${runs[0]}")
stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$root/$machine/caches"
merged="$root/$machine/run-$stamp.json"
"$harness" merge "${runs[@]}" -o "$merged"

while IFS= read -r cache; do
  dest="$root/$machine/caches/$(basename "$cache")"
  if [ -f "$dest" ]; then
    "$harness" cache merge "$dest" "$cache" -o "$dest"
  else
    cp "$cache" "$dest"
  fi
done < <(find "$shards_dir" -path "*/caches/*.json" | sort)

if [ -n "${GITHUB_ENV:-}" ]; then
  echo "HARNESS_MACHINE_ID=$machine" >> "$GITHUB_ENV"
  echo "HARNESS_MERGED_RUN=$merged" >> "$GITHUB_ENV"
fi
echo "merged run of $machine: $merged"
