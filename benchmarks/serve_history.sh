#!/usr/bin/env bash
# Does a server's history change what it serves? One `tidal serve` (Llama-3.1-8B shape, random
# weights, no speculation) driven by `tidal bench serve` with field_check's http workload at
# the loads of LOADS in turn (default "256 1 256 256": the c=256 cell before and after a
# c=1 run), then `tidal bench offline` at 256 for the in-process reference.
# Usage: OUT=dir [LOADS="256 1 256"] bash benchmarks/serve_history.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
M=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-.}
python3 benchmarks/common.py "$M" >/dev/null
ENGINE=(--model "$M/target" --load-format dummy --device cuda)
W2=(--random-input-len 512 --random-output-len 192 --temperature 0.7 --num-warmups 2)
python3 -m tidal serve "${ENGINE[@]}" --no-speculation --port 8179 >"$OUT/server.log" 2>&1 &
server=$!
until python3 -c "import httpx; httpx.get('http://127.0.0.1:8179/health').raise_for_status()" 2>/dev/null; do
  sleep 1; kill -0 $server || exit 1; done
i=0
for c in ${LOADS:-256 1 256 256}; do
  i=$((i + 1)); n=$([ "$c" = 1 ] && echo 8 || echo 512)
  python3 -m tidal bench serve --base-url http://127.0.0.1:8179 --label "run$i" --model "$M/target" "${W2[@]}" \
    --concurrency "$c" --num-prompts $n --output-json "$OUT/serve_${i}_c$c.json" 2>/dev/null | tail -1
done
kill -INT $server; wait $server
python3 -m tidal bench offline "${ENGINE[@]}" --modes none "${W2[@]}" --concurrency 256 --num-prompts 512 \
  --output-json "$OUT/offline_c256.json" 2>/dev/null | tail -1
