#!/usr/bin/env bash
# Served the way users serve it, on one GPU (Llama-3.1-8B shape, random weights, an
# EAGLE-3-shaped head, SIMULATED acceptance), each part with the tidal commands a user runs:
#   http     no speculation, 512-token prompts, 192 output tokens, temperature 0.7: `tidal serve`
#            + `tidal bench serve --base-url` at 1 and 256 clients, and `tidal bench offline` at 256
#            (the HTTP path's cost); with OLD_TREE=DIR, the same over HTTP from that source tree too
#   w2       W2 at 32 clients, fixed:3 and goodput, over HTTP (`tidal bench matrix`) and in-process,
#            with each mode's step log
#   w3       W3 (2048-token prompts) at 256 clients, goodput over HTTP: no request may fail
#   b1       batch-1 sampled decode, plain and EAGLE-3 K = 4 (benchmarks/sampled_b1.py), this tree
#            and OLD_TREE
#   matrix   `tidal bench matrix` with MATRIX_ARGS, with every mode's step log (goodput's with its
#            decisions; `benchmarks/step_kinds.py` reads it)
#   front    what the API process streams when the core costs nothing (benchmarks/front_capacity.py)
#   profile  http's c=256 load on this tree's server, with py-spy (if on PATH) sampling the API
#            process, the engine core's process and the benchmark client for PROFILE_SECONDS (15)
#            from PROFILE_DELAY (20) s after the load starts (1: the first wave's admission)
#   specprofile  the same for W5 (256/256, temperature 0.7, SIMULATED acceptance per request,
#            mean 0.6, std 0.25) at 32 clients, a server per mode of PROFILE_MODES (fixed:4 goodput)
# Usage: PARTS="http w2 w3" OUT=dir [OLD_TREE=dir] [SMOKE=1] bash benchmarks/field_check.sh
# Logs and JSON go to a work folder, packed into $OUT/field.tgz after every part.
set -uo pipefail
FINAL=${OUT:-out}; mkdir -p "$FINAL"
OUT=$(mktemp -d)
M=$(mktemp -d)
export PYTHONPATH=${PYTHONPATH:-.}
tidal() { python3 -m tidal "$@"; }
python3 benchmarks/common.py "$M" ${SMOKE:+smoke} >/dev/null
DEVICE=$([ -n "${SMOKE:-}" ] && echo cpu || echo cuda)  # SMOKE=1: tiny shapes on the CPU, to try the script
ENGINE=(--model "$M/target" --load-format dummy --device $DEVICE)
HEAD="\"method\": \"eagle3\", \"model\": \"$M/eagle3\", \"num_speculative_tokens\": 4"
W2=(--random-input-len 512 --random-output-len 192 --temperature 0.7 --num-warmups 2)
W5=(--random-input-len 256 --random-output-len 256 --temperature 0.7 --num-warmups 2)
W5_ACCEPTANCE='{"mean": 0.6, "std": 0.25}'

serve_and_bench() {  # LABEL TREE: a server from source tree TREE (. = this one), driven at 1 and 256 clients
  local label=$1 tree=$2 port=8177
  if [ "$tree" = . ]; then
    python3 -m tidal serve "${ENGINE[@]}" --no-speculation --port $port >"$OUT/server_$label.log" 2>&1 &
  else  # an older tree's CLI may lack --load-format: give its engine the flag's value directly
    (cd "$tree" && PYTHONPATH="$tree:$PYTHONPATH" exec python3 -c "
import sys, tidal.cli as cli, tidal.server.api as api
kwargs = cli.engine_kwargs
api.engine_kwargs = lambda args: {**kwargs(args), 'load_format': 'dummy'}
print('serving from', cli.__file__, flush=True)
sys.exit(cli.main(['serve', '--model', '$M/target', '--device', '$DEVICE', '--port', '$port']))
") >"$OUT/server_$label.log" 2>&1 &
  fi
  local pid=$!
  python3 -c "
import sys, time, httpx
for _ in range(1200):
    try:
        if httpx.get('http://127.0.0.1:$port/health').status_code == 200: break
    except httpx.TransportError: pass
    if open('/proc/$pid/stat').read().split()[2] == 'Z':  # exited (and not yet reaped)
        sys.exit('the server exited; its log: $OUT/server_$label.log')
    time.sleep(0.5)" || return 1
  tidal bench serve --base-url http://127.0.0.1:$port --label "$label" --model "$M/target" "${W2[@]}" \
    --concurrency 1 --num-prompts 8 --output-json "$OUT/http_${label}_c1.json" 2>/dev/null | tail -4
  tidal bench serve --base-url http://127.0.0.1:$port --label "$label" --model "$M/target" "${W2[@]}" \
    --concurrency 256 --num-prompts 512 --output-json "$OUT/http_${label}_c256.json" 2>/dev/null | tail -4
  kill -INT $pid; wait $pid
}

profile_load() {  # LABEL SERVER_FLAGS... -- BENCH_FLAGS...: a server under load, py-spy on its processes
  local label=$1 server_flags=() bench_flags=(); shift
  while [ "$1" != -- ]; do server_flags+=("$1"); shift; done; shift; bench_flags=("$@")
  python3 -m tidal serve "${ENGINE[@]}" "${server_flags[@]}" --port 8178 >"$OUT/server_$label.log" 2>&1 &
  local server=$!
  until python3 -c "import httpx; httpx.get('http://127.0.0.1:8178/health').raise_for_status()" 2>/dev/null; do
    sleep 1; kill -0 $server || break; done
  tidal bench serve --base-url http://127.0.0.1:8178 --label $label --model "$M/target" "${bench_flags[@]}" \
    --output-json "$OUT/${label}_load.json" 2>/dev/null | tail -4 &
  local bench=$!; sleep ${PROFILE_DELAY:-20}
  local core=$(pgrep -P $server -f spawn_main | head -1) client=$(pgrep -f "label $label" | head -1)
  top -b -n 1 -w 200 | head -20 >"$OUT/${label}_top.txt"
  for who in server core client; do
    py-spy record -p ${!who} -d ${PROFILE_SECONDS:-15} -r 100 -f raw --threads --nonblocking \
      -o "$OUT/${label}_$who.txt" >"$OUT/${label}_$who.log" 2>&1 &
  done
  wait $bench; kill -INT $server; wait $server
}

for part in ${PARTS:-http w2 w3}; do
  echo "=== $part"; start=$SECONDS
  case $part in
    http)
      serve_and_bench new .
      [ -n "${OLD_TREE:-}" ] && serve_and_bench old "$OLD_TREE"
      tidal bench offline "${ENGINE[@]}" --modes none "${W2[@]}" --concurrency 256 --num-prompts 512 \
        --output-json "$OUT/offline_c256.json" 2>/dev/null | tail -4 ;;
    w2)
      spec="{$HEAD, \"simulate_acceptance\": 0.7, \"decision_log\": \"$OUT/decisions_w2.jsonl\"}"
      tidal bench matrix "${ENGINE[@]}" --speculative-config "$spec" --workloads W2 --modes fixed:3,goodput \
        --concurrency 32 --requests-per-client 4 --output-json "$OUT/w2_http.json" --server-log "$OUT/w2_servers.log" \
        2>"$OUT/w2_http.log" | tail -8
      tidal bench offline "${ENGINE[@]}" --speculative-config "$spec" --modes fixed:3,goodput "${W2[@]}" \
        --concurrency 32 --num-prompts 128 --output-json "$OUT/w2_offline.json" 2>/dev/null | tail -8 ;;
    w3)
      tidal bench matrix "${ENGINE[@]}" --speculative-config "{$HEAD, \"simulate_acceptance\": 0.6}" \
        --workloads W3 --modes goodput --concurrency 256 --requests-per-client 1.5 \
        --output-json "$OUT/w3_c256.json" --server-log "$OUT/w3_server.log" 2>"$OUT/w3.log" | tail -6 ;;
    b1)
      PYTHONPATH=$PYTHONPATH:benchmarks python3 benchmarks/sampled_b1.py 2>"$OUT/b1_new.log" | tee "$OUT/b1_new.json"
      [ -n "${OLD_TREE:-}" ] && PYTHONPATH=$OLD_TREE:$PYTHONPATH:benchmarks python3 benchmarks/sampled_b1.py \
        2>"$OUT/b1_old.log" | tee "$OUT/b1_old.json" ;;
    front)
      PYTHONPATH=$PYTHONPATH:benchmarks python3 benchmarks/front_capacity.py 2>/dev/null | tee "$OUT/front.json" ;;
    profile)
      profile_load profile --no-speculation -- "${W2[@]}" --concurrency 256 --num-prompts 768 ;;
    specprofile)
      for mode in ${PROFILE_MODES:-fixed:4 goodput}; do
        k=${mode#fixed:}; [ "$k" = "$mode" ] && k=4
        spec="{\"method\": \"eagle3\", \"model\": \"$M/eagle3\", \"num_speculative_tokens\": $k, \"policy\": \"${mode%%:*}\", \"simulate_acceptance\": $W5_ACCEPTANCE}"
        profile_load "${mode/:/}" --speculative-config "$spec" -- "${W5[@]}" --concurrency 32 --num-prompts 192
      done ;;
    matrix)
      tidal bench matrix "${ENGINE[@]}" \
        --speculative-config "{$HEAD, \"simulate_acceptance\": 0.7, \"decision_log\": \"$OUT/decisions_matrix.jsonl\"}" \
        ${MATRIX_ARGS:-} --output-json "$OUT/matrix.json" --output-png "$OUT/matrix.png" \
        --server-log "$OUT/matrix_servers.log" 2>"$OUT/matrix.log" ;;
  esac
  echo "[$part: $((SECONDS - start)) s]"
  tar -czf "$FINAL/field.tgz" -C "$OUT" .
done
