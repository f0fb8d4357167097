#!/usr/bin/env bash
# test_serve.sh: tessera-serve as a user runs it, driven with curl on a loopback port: answers equal
# tessera-generate's; logprobs and beam search; a burst of concurrent requests (some malformed) is
# batched and each answer equals the request sent alone; bad requests get HTTP 400 with one line
# and the server keeps serving; TP2 x PP2 under mpirun answers the same; SIGTERM (1 rank; rank 0
# under mpirun) or SIGUSR1 (to mpirun) with 20 requests in flight: every request answered, exit 0.
# Usage: test_serve.sh BIN_DIR CONFIG_DIR VOCAB_DIR
set -u
bin=$1
configs=$2
vocab=$3
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; rm -rf "$work"; }
trap cleanup EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fail=0
# shellcheck source=../lib.sh
source "$(dirname "$0")/../lib.sh"  # ok, bad, losses, iteration_losses, metric
tokenizer=(--vocab-file "$vocab/encoder.json" --merge-file "$vocab/vocab.bpe")
# A GPT-2-vocabulary model (a few steps on mock data: its text is not English, but it is a model).
"$bin/tessera-train" --config "$configs/gpt2-tiny.ini" --vocab-size 50257 --train-iters 3 --threads 1 \
  --save "$work/ck" > "$work/train.log" 2>&1 || { bad "training: $(tail -2 "$work/train.log")"; exit 1; }

# start LOG CMD...: runs a server in the background; sets $port from its "listening" line.
start() {
  local log=$1
  shift
  "$@" > "$log" 2>&1 &
  pids+=($!)
  server=$!
  port=""
  for _ in $(seq 1 600); do
    port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$log" | grep -o '[0-9]*$')
    [ -n "$port" ] && return 0
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
  done
  bad "the server did not start: $(tail -3 "$log")"
  return 1
}
put() { curl -s -X PUT "http://127.0.0.1:$port/api" -H 'Content-Type: application/json' -d "$1"; }
code() { curl -s -o "$work/body" -w '%{http_code}' -X "${2:-PUT}" "http://127.0.0.1:$port${3:-/api}" -d "$1"; }
field() { python3 -c "import json, sys; d = json.load(sys.stdin); print(json.dumps($1))"; }

start "$work/serve.log" "$bin/tessera-serve" --load "$work/ck" --threads 1 --host 127.0.0.1 --port 0 \
  "${tokenizer[@]}" || exit 1
ok "listening on port $port"

# 1. Greedy text equals tessera-generate's.
g=$(put '{"prompts": ["Hello world"], "tokens_to_generate": 8, "temperature": 0}')
text=$(field 'd["text"][0]' <<<"$g")
want=$("$bin/tessera-generate" --load "$work/ck" --threads 1 "${tokenizer[@]}" --prompt "Hello world" \
       --max-new-tokens 8 --greedy 2>/dev/null)
[ -n "$want" ] && [ "$text" = "$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$want")" ] \
  && ok "greedy answer == tessera-generate: $text" || bad "greedy: server $text, tessera-generate '$want' ($g)"
nseg=$(field 'len(d["segments"][0])' <<<"$g")
[ "$nseg" = 10 ] && ok "segments: 2 prompt + 8 new tokens" || bad "segments: $nseg ($g)"

# 2. logprobs: one per token after the first, each < 0; tokens_to_generate 0 scores the prompt.
l=$(put '{"prompts": ["Hello world, again"], "tokens_to_generate": 4, "top_k": 1, "logprobs": true}')
[ "$(field 'len(d["logprobs"][0]) == len(d["segments"][0]) - 1 and all(x < 0 for x in d["logprobs"][0])' <<<"$l")" = true ] \
  && ok "logprobs: one per token after the first" || bad "logprobs: $l"
s=$(put '{"prompts": ["Hello world, again"], "tokens_to_generate": 0, "logprobs": true}')
[ "$(field 'd["logprobs"][0]' <<<"$s")" = "$(field 'd["logprobs"][0][:len(d["segments"][0]) - 5]' <<<"$l")" ] \
  && ok "tokens_to_generate 0 scores the prompt: the same prompt log-probabilities" || bad "scoring: $s vs $l"

bos=$(put '{"prompts": ["Hello"], "tokens_to_generate": 2, "top_k": 1, "add_BOS": true}')
[ "$(field 'd["segments"][0][:2]' <<<"$bos")" = '["<|endoftext|>", "Hello"]' ] \
  && ok "add_BOS: GPT-2's <|endoftext|> first" || bad "add_BOS: $bos"

# 3. Beam search: beam 1 is greedy; beam 3 gives 3 beams, best score first.
b1=$(put '{"prompts": ["Hello world"], "tokens_to_generate": 8, "beam_width": 1}')
[ "$(field 'd["text"][0]' <<<"$b1")" = "$text" ] && ok "beam_width 1 == greedy" || bad "beam 1: $b1"
b3=$(put '{"prompts": ["Hello world"], "tokens_to_generate": 6, "beam_width": 3, "length_penalty": 1.0}')
[ "$(field 'len(d["text"]) == 3 and d["scores"] == sorted(d["scores"], reverse=True)' <<<"$b3")" = true ] \
  && ok "beam_width 3: three beams, scores $(field 'd["scores"]' <<<"$b3")" || bad "beam 3: $b3"

# 4. A burst of concurrent requests, malformed ones among them: batched, each answer equals the
#    same request sent alone, each malformed one a 400.
burst=()
for i in $(seq 1 12); do
  body="{\"prompts\": [\"Request $i says\", \"and more $i\"], \"tokens_to_generate\": $((3 + i % 4)), \"temperature\": 0.9, \"top_k\": 20, \"random_seed\": $i}"
  echo "$body" > "$work/req.$i"
  (put "$body" > "$work/burst.$i") &
  burst+=($!)
done
for i in 1 2 3 4; do
  (code '{"prompts": ["oops"], "tokens_to_generate": "many"}' > "$work/badburst.$i") &
  burst+=($!)
done
wait "${burst[@]}"
same=0
for i in $(seq 1 12); do
  alone=$(put "$(cat "$work/req.$i")")
  [ -n "$alone" ] && [ "$alone" = "$(cat "$work/burst.$i")" ] && same=$((same + 1))
done
[ $same -eq 12 ] && ok "12 concurrent requests: each answer == the request alone" || bad "burst: $same of 12 equal"
[ "$(cat "$work"/badburst.* | tr -d '\n')" = 400400400400 ] && ok "4 malformed requests in the burst: 400 each" \
  || bad "malformed in the burst: $(cat "$work"/badburst.*)"
grep -q "batch of [0-9]* requests" "$work/serve.log" && ok "queued requests ran batched: $(grep -o 'batch of [0-9]* requests ([0-9]* prompts)' "$work/serve.log" | head -1)" \
  || bad "no batch of several requests in the log"

# 5. Bad requests: 400 (404/405 for the wrong path or method) and one line; the server keeps serving.
expect_code() {  # WANT BODY [METHOD [PATH]] -- GREP
  local want=$1 body=$2 method=${3:-PUT} path=${4:-/api} pattern=$5
  local c
  c=$(code "$body" "$method" "$path")
  if [ "$c" = "$want" ] && [ "$(wc -l < "$work/body")" -eq 1 ] && grep -qF -- "$pattern" "$work/body"; then
    ok "$want: $(cat "$work/body")"
  else
    bad "$body ($method $path): HTTP $c, '$(cat "$work/body")' (wanted $want, '$pattern')"
  fi
}
expect_code 400 '{"prompts": ["a"' PUT /api "the body is not JSON"
expect_code 400 '{"prompts": ["a"], "tokens_to_generate": -5}' PUT /api "tokens_to_generate must be an integer greater than or equal to 0"
expect_code 400 '{"prompts": ["a"], "temperature": 0.5, "colour": "red"}' POST /api "unknown field 'colour'"
expect_code 400 '{"prompts": "a"}' PUT /api "prompts is not a list of strings"
expect_code 400 "{\"prompts\": [\"$(printf 'word %.0s' $(seq 1 80))\"], \"tokens_to_generate\": 10}" PUT /api "more than the context of 64 positions"
expect_code 400 '{"prompts": ["a"], "tokens_to_generate": 100}' PUT /api "that is more than the context of 64 positions"
expect_code 400 '{"prompts": ["a", "b"], "beam_width": 2}' PUT /api "beam search takes one prompt per request"
expect_code 400 '{"prompts": [""], "tokens_to_generate": 2}' PUT /api "prompt 1 is empty"
expect_code 400 '{"prompts": ["a"], "stop_token": 99999999}' PUT /api "stop_token 99999999 is outside the vocabulary of 50257 tokens"
# Issue 27: 50,000 nested brackets crashed the server; a key twice was generated twice.
expect_code 400 "{\"prompts\": $(head -c 50000 /dev/zero | tr '\0' '[')" PUT /api "the body is not JSON: nesting deeper than 512 levels at byte 523"
expect_code 400 '{"prompts":["Hello"],"prompts":["Bye"]}' PUT /api 'the body is not JSON: duplicate key "prompts" at byte 21'
expect_code 405 '' GET /api "use PUT or POST"
expect_code 404 '{"prompts": ["a"]}' PUT /generate "no such path '/generate'"
again=$(put '{"prompts": ["Hello world"], "tokens_to_generate": 8, "temperature": 0}')
[ "$again" = "$g" ] && ok "after the bad requests the server answers as before" || bad "after bad requests: $again"
kill -0 "$server" 2>/dev/null && ok "the server is still running" || bad "the server died: $(tail -3 "$work/serve.log")"

# inflight TAG N: N concurrent requests in the background, each writing its HTTP status (000: no
# answer) to $work/TAG.N; their pids in $inflight_pids.
inflight() {
  local tag=$1 n=$2 i
  inflight_pids=()
  for i in $(seq 1 "$n"); do
    (curl -s -o /dev/null -w '%{http_code}' -X PUT "http://127.0.0.1:$port/api" \
       -d "{\"prompts\": [\"In flight $i\"], \"tokens_to_generate\": 40, \"temperature\": 0}" > "$work/$tag.$i") &
    inflight_pids+=($!)
  done
  sleep 0.5
}
# answered TAG N: every request got 200 or 503 (the batch running at the stop finishes, the queued
# ones are refused); prints the counts.
answered() {
  local tag=$1 n=$2 codes
  wait "${inflight_pids[@]}"
  codes=$(cat "$work/$tag".* | sed 's/\(...\)/\1\n/g' | sort | uniq -c | tr -s ' \n' ' ')
  [ "$(cat "$work/$tag".* | sed 's/\(...\)/\1\n/g' | grep -cE '^(200|503)$')" -eq "$n" ] && echo "$codes"
}

# 6. SIGTERM with 20 requests in flight: each is answered (200 or 503), the server exits 0.
inflight stop1 20
kill -TERM "$server"
wait "$server"
rc=$?
codes=$(answered stop1 20)
[ $rc -eq 0 ] && [ -n "$codes" ] && grep -q "stopped after" "$work/serve.log" \
  && ok "SIGTERM with 20 requests in flight: exit 0, every request answered ($codes)" \
  || bad "SIGTERM: rc $rc, answers $(cat "$work"/stop1.* | tr '\n' ' '): $(tail -3 "$work/serve.log")"

# 7. TP2 x PP2 under mpirun: rank 0 serves, all compute; the same answers.
start "$work/serve4.log" timeout 600 mpirun --oversubscribe --bind-to none -np 4 "$bin/tessera-serve" \
  --load "$work/ck" --threads 1 --host 127.0.0.1 --port 0 "${tokenizer[@]}" \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 || exit 1
g4=$(put '{"prompts": ["Hello world"], "tokens_to_generate": 8, "temperature": 0}')
[ "$g4" = "$g" ] && ok "TP2 x PP2: greedy answer == 1 rank" || bad "TP2 x PP2 greedy: $g4 vs $g"
s4=$(put "$(cat "$work/req.5")")
[ "$s4" = "$(cat "$work/burst.5")" ] && ok "TP2 x PP2: seeded sampling == 1 rank" || bad "TP2 x PP2 sampling: $s4"
b4=$(put '{"prompts": ["Hello world"], "tokens_to_generate": 6, "beam_width": 3, "length_penalty": 1.0}')
[ "$(field 'd["text"]' <<<"$b4")" = "$(field 'd["text"]' <<<"$b3")" ] && ok "TP2 x PP2: beam search == 1 rank" || bad "TP2 x PP2 beams: $b4 vs $b3"
# SIGTERM to rank 0 (its pid is in the listening line; scancel signals every rank alike): it
# finishes, tells the others, and every rank exits 0, so mpirun does.
rank0=$(grep -o 'listening on .*; pid [0-9]*' "$work/serve4.log" | grep -o '[0-9]*$')
inflight stop4 20
kill -TERM "$rank0"
wait "$server"
rc=$?
codes=$(answered stop4 20)
[ $rc -eq 0 ] && [ -n "$codes" ] && grep -q "stopped after 23 requests" "$work/serve4.log" \
  && ok "TP2 x PP2: SIGTERM to rank 0 with 20 requests in flight, every rank exits 0, every request answered ($codes)" \
  || bad "TP2 x PP2 stop: rc $rc, answers $(cat "$work"/stop4.* | tr '\n' ' '): $(tail -3 "$work/serve4.log")"
# SIGUSR1 to mpirun itself (it forwards SIGUSR1 to every rank; a SIGTERM to mpirun is an abort in
# Open MPI, whose ranks are killed a second later): the same clean stop, mpirun exits 0.
start "$work/serve2.log" mpirun --oversubscribe --bind-to none -np 2 "$bin/tessera-serve" \
  --load "$work/ck" --threads 1 --host 127.0.0.1 --port 0 "${tokenizer[@]}" \
  --tensor-model-parallel-size 2 || exit 1
inflight usr1 20
kill -USR1 "$server"
wait "$server"
rc=$?
codes=$(answered usr1 20)
[ $rc -eq 0 ] && [ -n "$codes" ] && grep -q "stopped after 20 requests" "$work/serve2.log" \
  && ok "TP2: SIGUSR1 to mpirun with 20 requests in flight, mpirun exits 0, every request answered ($codes)" \
  || bad "TP2 SIGUSR1 stop: rc $rc, answers $(cat "$work"/usr1.* | tr '\n' ' '): $(tail -3 "$work/serve2.log")"

# 8. A port in use: one line, exit 2.
python3 -c 'import socket, time; s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(60)' > "$work/busy" &
pids+=($!)
for _ in $(seq 1 50); do [ -s "$work/busy" ] && break; sleep 0.1; done
busy=$(cat "$work/busy")
out=$("$bin/tessera-serve" --load "$work/ck" --threads 1 --host 127.0.0.1 --port "$busy" "${tokenizer[@]}" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "error: --port $busy: cannot listen on 127.0.0.1:$busy: Address already in use" <<<"$out" \
  && ok "port in use -> rc 2" || bad "port in use: rc $rc: $out"

[ $fail -eq 0 ] && echo "tessera-serve: all passed"
exit $fail
