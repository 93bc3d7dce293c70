#!/usr/bin/env bash
# The H200 measurements of docs/benchmarks.md, run on the device machine from the repository
# root. That machine has no package index: MLX's CUDA build travels in parts
# (the workplace's mlx-cuda-parts.sh: `PART_MB=22 ... download` once, then `part N` for
# N = 1..4, each followed by a device call carrying .device-stage and running `stash`). A
# call carries the tracked tree (~41 MiB, the demo weights and docs/bench-data) plus what it
# names, 64 MiB in all: so 22 MiB parts, and the small wheels (mlx and mlx-lm, which `part 1`
# stages beside its part: move them; cattrs and xxhash for Python 3.12, which the image
# lacks) ride with the last, smallest part:
#   pip download --no-deps --python-version 3.12 --only-binary=:all: \
#       --platform manylinux_2_17_x86_64 cattrs xxhash -d .device-stage
# (`serve` also needs starlette, uvicorn, llguidance, uvloop, httptools, openai and their
# dependencies for Python 3.12, ~14 MiB: a call of their own).
# After the last part: `stash && install && MODE`. Results go under $OUT.
#
#   stash      copy .device-stage/* to $STASH (default ~/stash)
#   install    assemble the MLX-CUDA wheel, install the wheels and foretell into $SITE
#              (default ~/site)
#   reinstall  foretell again (after a change), the wheels as they are
#   specg      foretell bench --speculation, greedy rows, mlx-lm cold (~7 min on a fresh host)
#   specs      the same, sampled rows (~6 min)
#   paired     benchmarks/spec_paired.py, the adaptive rows paired (REPEATS, default 11;
#              ROWS, default "plain two-model self plain-t0.8 two-model-t0.8 mtp-t0.8")
#   cache4b    foretell bench --cache on the synthetic 4B shape (REPEATS, default 3;
#              KV_BITS=4|8: the KV quantized, as --kv-bits; SHAPE=0.6b: the 0.6B shape;
#              TAG: a suffix for its files)
#   pending2   cache4b at 8-bit KV with the spill worker at a quarter duty
#              (FORETELL_SPILL_DUTY=0.25; 1 on a 16-core host), then the 0.6B shape (~4 min)
#   verify     the GPU's own tests (~3 min): the block store's suite, the device digests',
#              the kept kernels', MLX's kernels' and the CPU run that must import no CUDA
#              module (TESTS: other paths), verbose (which GPU-only tests ran); ROW=1: then
#              cache4b at 8-bit KV (TAG=defaults)
#   digests    the device digests', kept kernels' and cross-thread cache tests, then cache4b
#              at 8-bit KV (REPEATS, default 7; TAG, default table) (~5 min)
#   batch      foretell bench --batch (BATCHES, default 1,4,16,32; DRAFTS, default
#              none,two-model,mtp; REPEATS, default 11), pinned to cores 2-7, against mlx-lm's
#              BatchGenerator (~3 min warm, ~6 on a fresh host)
#   lone       benchmarks/lone_request.py: a lone request through the scheduler against
#              Engine.generate, plain and drafting (DRAFT, default mtp; TOKENS, default 64;
#              REPEATS, default 11), pinned to cores 2-7 (~2 min)
#   shapes     benchmarks/first_shapes.py: each row count's first plain step and shared
#              prefill against the same met again (ROWS, default 24) (~2 min warm)
#   batchshapes foretell bench --batch on the synthetic 0.6B and 4B shapes, bf16 then 4-bit
#              (SHAPES, default 0.6b,4b; BATCHES, default 1,4,16,32; REPEATS, default 2), plain
#              rows against BatchGenerator (random weights: no drafter pays on them) (~6 min)
#   serve      benchmarks/serve_load.py: foretell serve plain, then two-model, against
#              mlx_lm.server on the same weights (LEVELS, default 1,2,4,8,16,32) (~6 min); needs
#              the serve wheels staged too (starlette, uvicorn, llguidance, openai and theirs);
#              the clients in CLIENTS processes (default 4: one openai client process is most
#              of a core at the GPU's chunk rates)
#   serveburst serve_load.py at c = 1 and 16, levels of SECONDS_A_LEVEL (default 20) each, both
#              servers, lengths all 64 then drawn from 32-96, then the compute floor of a
#              16-prompt burst (~3 min)
#   servewarm  the serve warm-up's A/B on a fresh server each side, MLX's kept kernels emptied
#              before each and no client warm-up wave: foretell serve with --no-warm-shapes, then
#              with the warm-up (SIDES, default "nowarm warm"; LEVEL_S seconds a level, default
#              15), c = 1 and 16, lengths 32-96; the start-up time each side took (~4 min)
#   widths     benchmarks/batch_widths.py: fixed draft widths against the batch policy, with
#              width 1 offered too (B, default 4; WIDTHS, default 1,2; REPEATS, default 15)
#   firstrun   on a fresh host: foretell run's first run (precompiling), again, then with
#              the kernel caches emptied and precompiling off
#   x CMD...   anything else, with the environment set
set -uo pipefail
STASH=${STASH:-$HOME/stash}
SITE=${SITE:-$HOME/site}
MLX_VERSION=${MLX_VERSION:-0.32.4}
export PYTHONPATH=$SITE
export PATH=$SITE/bin:$PATH
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=python3
spec_common=(--model demo --speculation --new-lengths --prompt-tokens 992 --generate 256 --repeats 3)
case "${1:-}" in
stash)
  mkdir -p "$STASH" && cp .device-stage/* "$STASH"/ && ls -la "$STASH" | tail -n +2
  ;;
install)
  cd "$STASH"
  if ls mlxcuda.part.* >/dev/null 2>&1; then
    cat mlxcuda.part.* > "mlx_cuda_13-$MLX_VERSION-py3-none-manylinux_2_35_x86_64.whl" && rm mlxcuda.part.*
  fi
  $PY -m pip install -q --no-index --no-deps --target "$SITE" ./*.whl 2>&1 | tail -3
  cd - >/dev/null
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" --upgrade . ./contrib/foretell-ngram 2>&1 | tail -3
  $PY -c "import mlx.core as mx, foretell; print('mlx', mx.__version__, mx.default_device(), 'foretell', foretell.__file__)"
  ;;
reinstall)
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" --upgrade . ./contrib/foretell-ngram 2>&1 | tail -3
  ;;
specg)
  nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
  timeout 580 taskset -c 4-7 $PY -m foretell bench "${spec_common[@]}" --cold-mlx-lm \
    --scenario plain --scenario two-model --scenario self --scenario mtp --scenario ngram-edit \
    --json "$OUT/spec-greedy.json" 2>&1 | tee "$OUT/spec-greedy.log" | tail -40
  ;;
specs)
  timeout 580 taskset -c 4-7 $PY -m foretell bench "${spec_common[@]}" --cold-mlx-lm \
    --scenario plain-t0.8 --scenario two-model-t0.8 --scenario two-model-t0.8-fixed \
    --scenario two-model-t0.8-match --scenario mtp-t0.8 \
    --json "$OUT/spec-sampled.json" 2>&1 | tee "$OUT/spec-sampled.log" | tail -40
  ;;
paired)
  timeout "${PAIRED_S:-300}" taskset -c 4-7 $PY benchmarks/spec_paired.py --model demo --new-lengths \
    --prompt-tokens 992 --generate 256 --repeats "${REPEATS:-11}" \
    $(printf -- '--row %s ' ${ROWS:-plain two-model self plain-t0.8 two-model-t0.8 mtp-t0.8}) \
    --json "$OUT/spec-paired.json" 2>&1 | tee "$OUT/spec-paired.log" | tail -30
  ;;
cache4b)
  name="cache-${SHAPE:-4b}${KV_BITS:+-kv$KV_BITS}${TAG:+-$TAG}"
  timeout 580 $PY -m foretell bench --cache --synthetic "${SHAPE:-4b}" --dtype bfloat16 \
    --cache-prompt-tokens 4096 --repeats "${REPEATS:-3}" --generate 64 ${KV_BITS:+--kv-bits $KV_BITS} \
    --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | tail -30
  ;;
pending2)
  FORETELL_SPILL_DUTY=0.25 KV_BITS=8 TAG=duty-0.25 bash "$0" cache4b
  SHAPE=0.6b bash "$0" cache4b
  ;;
verify)
  timeout 280 $PY -X faulthandler -m pytest -v -rs -p no:cacheprovider \
    ${TESTS:-tests/blockstore tests/cache/test_device_digest.py tests/core/test_kept_kernels.py
      tests/core/test_kernels.py tests/core/test_backend_neutral.py} \
    > "$OUT/verify-tests.log" 2>&1; echo "pytest rc $?" >> "$OUT/verify-tests.log"
  grep -E "cuda|gpu|device|kept|dma|landing|rc |passed|failed|SKIP|Fatal" "$OUT/verify-tests.log" | tail -40
  if [ "${ROW:-0}" = 1 ]; then KV_BITS=8 TAG=defaults bash "$0" cache4b; fi
  ;;
digests)
  e=tests/cache/test_engine_cache.py
  TESTS="tests/cache/test_device_digest.py tests/core/test_kept_kernels.py
    tests/blockstore/test_device_digests.py tests/blockstore/test_blocks_layout.py
    $e::test_a_request_on_another_thread_reuses_what_an_earlier_one_stored
    $e::test_engines_on_two_threads_at_once_share_one_tier" ROW=0 \
    bash "$0" verify
  KV_BITS=8 TAG=${TAG:-table} REPEATS=${REPEATS:-7} bash "$0" cache4b
  ;;
batch)
  # Pinned, 11 turns: one side's turns swing 1.5-2x on the lent hosts (docs/benchmarks.md).
  timeout 580 taskset -c 2-7 $PY -m foretell bench --batch "${BATCHES:-1,4,16,32}" \
    --batch-drafts "${DRAFTS:-none,two-model,mtp}" --repeats "${REPEATS:-11}" \
    --json "$OUT/batch.json" 2>&1 | tee "$OUT/batch.log" | tail -20
  ;;
lone)
  timeout 280 taskset -c 2-7 $PY benchmarks/lone_request.py --draft "${DRAFT:-mtp}" \
    --max-tokens "${TOKENS:-64}" --repeats "${REPEATS:-11}" \
    --json "$OUT/lone-${DRAFT:-mtp}-${TOKENS:-64}.json" 2>&1 | tee "$OUT/lone-${DRAFT:-mtp}-${TOKENS:-64}.log" | tail -8
  ;;
shapes)
  timeout 280 taskset -c 2-7 $PY benchmarks/first_shapes.py --rows "${ROWS:-24}" \
    --json "$OUT/first-shapes.json" 2>&1 | tee "$OUT/first-shapes.log" | tail -12
  ;;
batchshapes)
  for bits in "" 4; do
    timeout 290 $PY -m foretell bench --batch "${BATCHES:-1,4,16,32}" --batch-drafts none \
      --synthetic "${SHAPES:-0.6b,4b}" --dtype bfloat16 ${bits:+--bits $bits} --repeats "${REPEATS:-2}" \
      --json "$OUT/batch-shapes${bits:+-q$bits}.json" 2>&1 | tee "$OUT/batch-shapes${bits:+-q$bits}.log" | tail -12
  done
  ;;
serve)
  levels=${LEVELS:-1,2,4,8,16,32}
  timeout 290 $PY benchmarks/serve_load.py --model demo --levels "$levels" --no-float32-mlx-lm \
    --client-processes "${CLIENTS:-4}" --json "$OUT/serve.json" 2>&1 | tee "$OUT/serve.log" | tail -20
  timeout 200 $PY benchmarks/serve_load.py --model demo --levels "$levels" --servers foretell \
    --draft two-model --draft-model demo-draft --client-processes "${CLIENTS:-4}" \
    --json "$OUT/serve-two-model.json" 2>&1 | tee "$OUT/serve-two-model.log" | tail -12
  ;;
serveburst)
  timeout 200 $PY benchmarks/serve_load.py --model demo --levels 1,16 --no-float32-mlx-lm \
    --level-seconds "${SECONDS_A_LEVEL:-20}" --client-processes "${CLIENTS:-4}" \
    --json "$OUT/serve-burst.json" 2>&1 | tee "$OUT/serve-burst.log" | tail -8
  timeout 290 $PY benchmarks/serve_load.py --model demo --levels 1,16 --no-float32-mlx-lm \
    --level-seconds "${SECONDS_A_LEVEL:-20}" --client-processes "${CLIENTS:-4}" \
    --max-tokens-spread 32 --floor-repeats 5 \
    --json "$OUT/serve-burst-spread.json" 2>&1 | tee "$OUT/serve-burst-spread.log" | tail -12
  ;;
servewarm)
  for side in ${SIDES:-nowarm warm}; do
    rm -rf ~/.cache/foretell/mlx-kernels ~/.nv/ComputeCache /tmp/mlx
    extra=(); [ "$side" = nowarm ] && extra=(--serve-arg=--no-warm-shapes)
    echo "=== $side $(date -u +%T)"
    timeout 280 $PY benchmarks/serve_load.py --model demo --levels 1,16 --servers foretell \
      --level-seconds "${LEVEL_S:-15}" --client-processes 4 --max-tokens-spread 32 \
      --no-float32-mlx-lm --no-warm "${extra[@]}" --json "$OUT/servewarm-$side.json" 2>&1 \
      | tee "$OUT/servewarm-$side.log" | tail -8
  done
  ;;
widths)
  timeout 280 taskset -c 2-7 $PY benchmarks/batch_widths.py --batch "${B:-4}" \
    --repeats "${REPEATS:-15}" --widths "${WIDTHS:-1,2}" --with-width-one 2>&1 \
    | tee "$OUT/widths-b${B:-4}.log" | tail -6
  ;;
firstrun)
  TIMEFORMAT="%R s wall, %U s user"
  once() { time (timeout 400 $PY -m foretell run --max-tokens 16 -p Hello 2>&1 | grep -v "^[A-Z]" | tail -3); }
  kept() { ls -l --time-style=+%T ~/.cache/foretell/mlx-kernels/* | grep -c ptx; du -sh ~/.nv/ComputeCache; }
  listing() { ls -l --time-style=+%T ~/.cache/foretell/mlx-kernels/* | awk '/ptx|done/ {print $6, $7}'; }
  { echo "1. kernel caches empty"; rm -rf ~/.nv/ComputeCache ~/.cache/foretell/mlx-kernels /tmp/mlx
    date -u +%T; once; kept; listing
    echo "2. again"; once
    echo "3. both emptied, precompiling off"; rm -rf ~/.nv/ComputeCache ~/.cache/foretell/mlx-kernels /tmp/mlx
    date -u +%T; FORETELL_PRECOMPILE_KERNELS=off once; kept; listing; } 2>&1 | tee "$OUT/first-run.log"
  ;;
x)
  shift; eval "$@"
  ;;
*) sed -n "2,/^set -uo/p" "$0" | sed '$d'; exit 2 ;;
esac
