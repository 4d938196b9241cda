#!/usr/bin/env bash
# One call on a GPU machine: install what is missing, check correctness, then time.
#   bash scripts/gpu_check.sh check        # GPU tests (kernels at size, engine vs HF), kernel bench
#   bash scripts/gpu_check.sh bench        # L1 and W1 twice each with their HF peers, then W2
#   bash scripts/gpu_check.sh compare DIR  # L1 and W1 (two passes each) from another tree DIR
#                                          # (e.g. the last release) and from this one, one machine
#   bash scripts/gpu_check.sh house DIR    # engine memory given back, two 7B engines in turn;
#                                          # Gluon prefill tests; then compare DIR
#   bash scripts/gpu_check.sh bigbatch ["SEQS..."] # decode graphs past 512 sequences: W2 FP8
#                                          # weights + KV at each max_num_seqs (512 1024)
#   bash scripts/gpu_check.sh serving      # H1 over the OpenAI API and S1 over WebSocket, W1 shape
#   bash scripts/gpu_check.sh longmix [BUDGETS] # prompts 32-8192, outputs 32-1024 over the OpenAI
#                                          # API at 6 and 12 req/s, once per chunked-prefill budget
#                                          # (default 2048,4096,8192,16384; 2-3 min each)
#   bash scripts/gpu_check.sh nsample      # engine GPU tests; W1 prompts with n = 8 against 8x requests
#   bash scripts/gpu_check.sh quant [quick] # quantized kernels and formats on the GPU; L1/W1 per
#                                          # format (quick: L1 GPTQ int4/int8 only)
#   bash scripts/gpu_check.sh fp8          # FP8 kernel/engine GPU tests; L1 FP8 and int4, W1 with FP8 KV
#   bash scripts/gpu_check.sh w2 [SEQS]    # W2 with FP8 weights and KV (max_num_seqs SEQS), then bf16
#   bash scripts/gpu_check.sh fp8speed [SEQS] # FP8 KV: attention GPU tests, decode sweep, W1, W2
#   bash scripts/gpu_check.sh attn [SEQS]  # attention GPU tests, prefill kernel bench, W1 (FP8 KV, bf16)
#   bash scripts/gpu_check.sh prefill      # Gluon prefill kernel: GPU tests with the engine's,
#                                          # kernel bench, W1 and L1 with it and without, W2
#   bash scripts/gpu_check.sh kvw [SEQS]   # W1 FP8 KV and W2 FP8 weights + KV, each beside bf16
#   bash scripts/gpu_check.sh pairs        # GEMVs in half-precision pairs: GPU tests, kernels, L1
#                                          # in GPTQ int4/int8 and FP8
#   bash scripts/gpu_check.sh gemv [kernels] # one-row int4/int8 GEMVs: GPU tests, kernels, L1
#   bash scripts/gpu_check.sh fp8row       # FP8 one-row GEMVs: GPU tests, kernels with their
#                                          # input transforms, L1 FP8 (profiled) and bf16
#   bash scripts/gpu_check.sh structured   # structured-output GPU tests; W1 free vs every request
#                                          # JSON-constrained (async scheduling, then --sync)
#   bash scripts/gpu_check.sh rows         # few-row matmul and spec decoding: GPU tests, kernels
#                                          # against cuBLAS, verify step and latency, L1, W1
#   bash scripts/gpu_check.sh session DIR # spec/graph/quant GPU tests, verify-step bench, cold
#                                          # int4 start, L1 per quantized format, compare DIR
#   bash scripts/gpu_check.sh qgemm [ROWS]  # integer GEMM: GPU tests, kernels at W1 layers, L1 int4/int8
#   bash scripts/gpu_check.sh kvprof       # FP8 decode attention: GPU tests, sweep, ncu per case
#   bash scripts/gpu_check.sh kvtiles DIR  # decode tiles: GPU tests, sweep, compare DIR, W1/W2 FP8
#   bash scripts/gpu_check.sh next OLD LANDED # L1 from trees OLD, LANDED and this one; W1 from
#                                          # OLD and this one; the verify-step bench (SPEC=0: not)
#   bash scripts/gpu_check.sh l1formats DIR # L1 in bf16, GPTQ int4 and FP8 from DIR and this tree
#   bash scripts/gpu_check.sh stage        # staged small steps: engine/graph/spec GPU tests, spec bench, L1
#   bash scripts/gpu_check.sh qw1          # W1 in bf16, GPTQ int4 and int8
#   bash scripts/gpu_check.sh int4         # int4/int8 wgmma matmul: GPU tests, kernels at 1-64 rows
#                                          # in int4 (BITS="4 8": both)
#   bash scripts/gpu_check.sh int4l1 DIR   # its GPU tests and kernels, L1 GPTQ int4 (and int8 with
#                                          # BITS="4 8") from DIR and here (W1=1: then W1 in
#                                          # each and bf16 from here)
#   bash scripts/gpu_check.sh draftkv DIR  # draft proposer and plans before the memory profile:
#                                          # GPU tests, draft cost, verify-step kernels, cold
#                                          # int4 start, L1/W1 bf16 and W1 int8 from DIR and here
#   bash scripts/gpu_check.sh recheck DIR  # the quantization refactors on the GPU: tests, an
#                                          # L1 start per format, the int8 ring, the verify
#                                          # step; PARTS="attn kvsweep fp8kv": the decode
#                                          # tiles' GPU tests, the kvfp8 sweep, L1/W1 over an
#                                          # FP8 cache from DIR and here; PARTS="compare w2":
#                                          # L1/W1 from DIR and here, W2 FP8 at 3,000 requests
#   bash scripts/gpu_check.sh tp           # several GPUs: TP tests, TP=1/2/4/8 check and bench
#   bash scripts/gpu_check.sh router       # multi-turn chat through vllm-router, two replicas
#                                          # sharing GPU 0: cache_aware against round_robin
# To reuse one call's compiled kernels and tuned plans in the next, copy its caches.tgz.*
# files into .device_cache/ here and carry that folder (with .whl: scripts/device_wheels.sh).
# Logs and JSON lines go to $OUT (or ./out) and a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 ASYNCENGINE_CACHE=/tmp/asyncengine-cache TRITON_CACHE_DIR=/tmp/triton-cache
# Compiled Triton kernels and tuned matmul plans from an earlier call, if carried
# (.device_cache/, the caches.tgz.* parts of that call's $OUT): both are keyed by their
# sources, so only what still matches is used, and a call spends its time timing rather
# than compiling.
if ls .device_cache/caches.tgz.* >/dev/null 2>&1; then
  cat .device_cache/caches.tgz.* | tar -xzf - -C /tmp
fi
save_caches() {  # on exit: the caches back to $OUT in parts a call returns (3 x 15 MB at most)
  if [ -n "${NO_CACHES:-}" ]; then return; fi  # leave the call's few files to the results
  tar -czf - -C /tmp triton-cache asyncengine-cache/matmul_plans 2>/dev/null \
    | split -b 15000000 -d - "$OUT/caches.tgz."
  if [ -e "$OUT/caches.tgz.03" ]; then rm -f "$OUT"/caches.tgz.*; fi
}
trap save_caches EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

phase="${1:-check}"
bench() { python3 scripts/bench_throughput.py "$@" 2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl"; }
tree_bench() {  # TREE ARGS...: bench_throughput.py of another tree, its lines tagged with it
  local tree="$1"; shift  # (TREE_TIMEOUT: seconds a run may take)
  # This tree's entry of PYTHONPATH becomes TREE's (substituted before the cd changes $PWD).
  (export PYTHONPATH="${PYTHONPATH/$PWD/$tree}"; cd "$tree" && timeout "${TREE_TIMEOUT:-600}" \
    python3 scripts/bench_throughput.py \
    --system engine "$@" 2>>"$OUT/bench.log") \
    | sed "s|^{|{\"tree\": \"$(basename "$tree")\", |" | tee -a "$OUT/compare.jsonl"
}
wgmma_kernels() {  # the wgmma matmul's and kind's GPU tests, then its kernel bench per width
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/asyncengine_kernels/test_quant_wgmma.py tests/models/quantization/test_kinds.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 6
  for bits in ${BITS:-4}; do
    timeout 420 python3 scripts/bench_kernels.py --only "int$bits" 2>>"$OUT/bench.log" \
      | tee "$OUT/int${bits}_kernels.jsonl"
  done
}
serving() {  # W1's model and lengths behind `asyncengine serve`
  python3 scripts/bench_serving.py --shape llama2-7b --device cuda --input-len 512 \
    --output-len 256 --skip-tokenizer-init --load-format dummy "$@" 2>>"$OUT/bench.log" \
    | tee -a "$OUT/serving.jsonl"
}
gpu_tests() {
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels tests/models \
    tests/asyncengine/test_gpu_engine.py tests/asyncengine/test_sampler.py \
    tests/asyncengine/test_cuda_graphs.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 12
}
if [ "$phase" = check ]; then
  gpu_tests
  python3 scripts/bench_kernels.py 2>>"$OUT/bench.log" | tee "$OUT/kernels.jsonl" | tail -n 4
  bench --workload smoke --system engine
elif [ "$phase" = bench ]; then
  bench --workload l1 --system engine --repeat 2
  bench --workload w1 --system engine --repeat 2
  bench --workload l1 --system hf
  bench --workload w1 --system hf --hf-batch-size 128
  bench --workload w2 --system engine
elif [ "$phase" = compare ]; then  # the same workloads from two trees, alternating
  other="${2:?usage: gpu_check.sh compare DIR}"
  for w in l1 w1; do
    for tree in "$other" "$PWD"; do tree_bench "$tree" --workload "$w" --repeat "${REPEAT:-2}"; done
  done
elif [ "$phase" = house ]; then  # an engine gives its memory back (two 7B engines in one
  # process), the Gluon prefill tests, then L1/W1 from another tree DIR and from this one
  python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/asyncengine/test_engine_shutdown.py \
    tests/asyncengine_kernels/test_prefill_attention_hopper.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 12
  bash "$0" compare "${2:?usage: gpu_check.sh house DIR}"
elif [ "$phase" = capabilities ]; then  # L1/W1 from DIR and this tree (one pass each), then
  # W1 free against JSON-constrained (the tokenizer carried in .device_tok)
  REPEAT=1 bash "$0" compare "${2:?usage: gpu_check.sh capabilities DIR}"
  bench --workload w1 --system engine --structured-outputs json --tokenizer "${3:-.device_tok}"
elif [ "$phase" = serving ]; then  # H1 (OpenAI HTTP) and S1 (WebSocket) at saturation
  serving --api openai --rates inf --num-requests 256
  serving --api websocket --rates inf --num-requests 256 --skip-offline
elif [ "$phase" = longmix ]; then  # issue #20 item 4: TTFT/ITL per chunked-prefill budget
  python3 scripts/bench_serving.py --workload long-mixed --device cuda \
    --max-num-batched-tokens-sweep "${2:-2048,4096,8192,16384}" 2>>"$OUT/bench.log" \
    | tee "$OUT/longmix.part" | grep '^{' | cut -c1-300
  cat "$OUT/longmix.part" >> "$OUT/longmix.txt"; grep '^{' "$OUT/longmix.part" >> "$OUT/serving.jsonl"
elif [ "$phase" = router ]; then  # issue #32 item 5: does cache-aware routing pay?
  # The 7B shape with dummy weights and the tokenizer carried in TOKDIR (default .device_tok:
  # the embedded SmolLM2's tokenizer files; the embedded weights do not travel to the GPU).
  python3 scripts/bench_serving.py multi-turn --device cuda --data-parallel-size 2 \
    --shape llama2-7b --tokenizer-dir "${2:-.device_tok}" \
    --replicas-per-gpu 2 --gpu-memory-utilization 0.45 --num-conversations 64 --turns 6 \
    --system-prompts 8 --system-len 1500 --user-len 60 --max-tokens 128 --concurrency 32 \
    2>>"$OUT/bench.log" | tee "$OUT/router.txt" | cut -c1-300
  grep '^{' "$OUT/router.txt" >> "$OUT/serving.jsonl" || true
elif [ "$phase" = spec ]; then  # engine GPU tests (greedy = HF, graphs, prompt logprobs, spec
  # decode); speculative decoding: verify step k = 1..8, latency at acceptance 0 / 0.5 / 0.7 /
  # 0.9, throughput by batch (7B shape, dummy weights); a 160M draft's cost per proposal
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine/test_gpu_engine.py \
    tests/asyncengine/test_cuda_graphs.py tests/asyncengine/test_prompt_logprobs.py \
    tests/asyncengine/spec_decode 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 6
  python3 -m scripts.bench_spec_decode gpu --shape llama2-7b 2>>"$OUT/bench.log" \
    | tee "$OUT/spec_decode.jsonl"
  # The draft model's cost per proposal, its one-token steps in CUDA graphs and eager.
  python3 -m scripts.bench_spec_decode draft 2>>"$OUT/bench.log" | tee "$OUT/spec_draft.jsonl"
elif [ "$phase" = rows ]; then  # few-row matmuls and speculative decoding: their GPU tests,
  # the verify step and latency by acceptance, L1 and W1, the few-row kernels against cuBLAS
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_skinny_gemm.py \
    tests/asyncengine/spec_decode 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 6
  timeout 270 python3 -m scripts.bench_spec_decode gpu --shape llama2-7b --batches 1 \
    2>>"$OUT/bench.log" | tee "$OUT/spec_decode.jsonl" | cut -c1-900
  bench --workload l1 --system engine
  bench --workload w1 --system engine
  [ -n "${SKIP_KERNELS:-}" ] || timeout 90 python3 scripts/bench_kernels.py --only skinny 2>>"$OUT/bench.log" \
    | tee "$OUT/skinny.jsonl" | cut -c1-200
elif [ "$phase" = probe ]; then  # where the time goes: FP8-KV decode attention against the copy
  # rate; a verify step's phases and kernels; a cold GPTQ int4 start's tuning (winners logged)
  timeout 150 python3 scripts/bench_kernels.py --only kvfp8 2>>"$OUT/bench.log" \
    | tee "$OUT/kvfp8.jsonl" | cut -c1-400
  timeout 300 python3 -m scripts.bench_spec_decode gpu --shape llama2-7b --batches 1 4 \
    2>>"$OUT/bench.log" | tee "$OUT/spec_decode.jsonl" | cut -c1-600
  time timeout 240 python3 -c "import logging, runpy, sys; logging.basicConfig(level=logging.INFO,
    format='%(relativeCreated)d %(name)s %(message)s'); logging.getLogger('models.linear_tuning').setLevel(logging.DEBUG); sys.argv[0] = 'bench_throughput.py'
runpy.run_path('scripts/bench_throughput.py', run_name='__main__')" --workload l1 --system engine \
    --quantization gptq-int4 2>"$OUT/int4_cold.log" | tee -a "$OUT/results.jsonl"
  grep -c "rows:" "$OUT/int4_cold.log"
elif [ "$phase" = tuning ]; then  # cold starts with every kind's tuning time logged, per format
  # (default: gptq-int8 awq-int4 fp8), and the speculative decoding verify-step profile
  timeout 300 python3 -m scripts.bench_spec_decode gpu --shape llama2-7b --batches 1 4 \
    2>>"$OUT/bench.log" | tee "$OUT/spec_decode.jsonl" | cut -c1-700
  for q in ${2:-gptq-int8 awq-int4 fp8}; do
    timeout 200 python3 -c "import logging, runpy, sys; logging.basicConfig(level=logging.INFO,
    format='%(relativeCreated)d %(name)s %(message)s'); logging.getLogger('models.linear_tuning').setLevel(logging.DEBUG); sys.argv[0] = 'bench_throughput.py'
runpy.run_path('scripts/bench_throughput.py', run_name='__main__')" --workload l1 --system engine \
      --quantization "$q" 2>"$OUT/tuning_$q.log" | tee -a "$OUT/results.jsonl" | cut -c1-300
  done
elif [ "$phase" = session ]; then  # GPU tests of speculative decoding, graphs and quantized
  # matmuls; the verify step (k = 1..8) and latency by acceptance; a cold GPTQ int4 start
  # (empty caches), then L1 per quantized format; L1/W1 from DIR and from this tree; W1 with
  # every request JSON-constrained (the tokenizer carried in .device_tok)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine/spec_decode \
    tests/asyncengine/test_cuda_graphs.py tests/asyncengine_kernels/test_quant_linear.py \
    tests/asyncengine_kernels/test_fp8_linear.py tests/models/test_linear_tuning.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 6
  timeout 240 python3 -m scripts.bench_spec_decode gpu --shape llama2-7b --batches 1 \
    2>>"$OUT/bench.log" | tee "$OUT/spec_decode.jsonl" | cut -c1-400
  ASYNCENGINE_CACHE=/tmp/cold-cache TRITON_CACHE_DIR=/tmp/cold-triton timeout 200 \
    python3 scripts/bench_throughput.py --workload l1 --system engine --quantization gptq-int4 \
    2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl" | cut -c1-500
  for q in ${3:-gptq-int8 awq-int4 fp8}; do
    timeout 150 python3 scripts/bench_throughput.py --workload l1 --system engine \
      --quantization "$q" 2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl" | cut -c1-500
  done
  REPEAT=1 bash "$0" compare "${2:?usage: gpu_check.sh session DIR}"
  if [ -d .device_tok ]; then
    timeout 150 python3 scripts/bench_throughput.py --workload w1 --system engine \
      --structured-outputs json --tokenizer .device_tok 2>>"$OUT/bench.log" \
      | tee -a "$OUT/results.jsonl" | cut -c1-500
  fi
elif [ "$phase" = qgemm ]; then  # the integer GEMM on 16-bit tiles: GPU tests, kernels at W1's
  # layers and rows against cuBLAS / dequantize + cuBLAS / tinygemm, L1 and W1 per format
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_quant_linear.py \
    tests/models/test_linear_tuning.py tests/models/quantization 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 6
  timeout 150 python3 scripts/bench_kernels.py --only quant --quant-rows ${2:-16 64 128 256} \
    --quant-shapes w1 2>>"$OUT/bench.log" | tee "$OUT/quant_kernels.jsonl" \
    | python3 scripts/best_kernels.py | cut -c1-200
  for q in gptq-int4 gptq-int8; do
    timeout 120 python3 scripts/bench_throughput.py --workload l1 --system engine \
      --quantization "$q" 2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl" | cut -c1-300
  done
elif [ "$phase" = qw1 ]; then  # W1 in bf16 and per integer format, one machine
  for q in none gptq-int4 gptq-int8; do
    flag=$([ "$q" = none ] || echo "--quantization $q")
    timeout 170 python3 scripts/bench_throughput.py --workload w1 --system engine $flag \
      2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl" | cut -c1-300
  done
elif [ "$phase" = stage ]; then  # small decode steps staged whole into the graphs' inputs:
  # engine, graph and spec GPU tests; verify step and latency by acceptance; L1 bf16 and int4
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine/test_gpu_engine.py \
    tests/asyncengine/test_cuda_graphs.py tests/asyncengine/spec_decode \
    tests/asyncengine/test_prompt_logprobs.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 6
  timeout 240 python3 -m scripts.bench_spec_decode gpu --shape llama2-7b --batches 1 \
    2>>"$OUT/bench.log" | tee "$OUT/spec_decode.jsonl" | cut -c1-600
  for q in none gptq-int4; do
    flag=$([ "$q" = none ] || echo "--quantization $q")
    timeout 120 python3 scripts/bench_throughput.py --workload l1 --system engine $flag \
      2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl" | cut -c1-300
  done
elif [ "$phase" = kvprof ]; then  # FP8 decode attention: the attention GPU tests, the
  # sweep (launch order, tiles, warps, stages), then Nsight Compute on one launch per case
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_paged_attention.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 4
  timeout 300 python3 scripts/bench_kernels.py --only kvfp8 2>>"$OUT/bench.log" \
    | tee "$OUT/kernels.jsonl" | cut -c1-240
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  i=0
  for spec in ${NCU_CASES:-W1:fp8:0 W1:fp8:1 W2:fp8:1 W1:bf16:0}; do
    if [ "$spec" = skip ]; then break; fi
    IFS=: read -r w kv major <<<"$spec"; i=$((i + 1))
    timeout 120 "$ncu_bin" --clock-control none --kernel-name regex:_paged_attention_kernel \
      --launch-skip 2 --launch-count 1 --set full \
      python3 scripts/run_decode_attention.py --workload "$w" --kv "$kv" \
      --tiles "{\"HEAD_MAJOR\": $major}" > "$OUT/ncu_${i}_${w}_${kv}_hm${major}.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible" \
      "$OUT/ncu_${i}_${w}_${kv}_hm${major}.txt" | sed "s|^|$w $kv hm$major |" | head -n 12
  done
elif [ "$phase" = kvtiles ]; then  # decode attention tiles for many programs: attention and
  # engine GPU tests, the sweep, L1/W1 from DIR and this tree, W1 FP8 KV, W2 FP8 weights + KV
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_paged_attention.py \
    tests/asyncengine/test_gpu_engine.py tests/asyncengine/test_cuda_graphs.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 4
  timeout 200 python3 scripts/bench_kernels.py --only kvfp8 2>>"$OUT/bench.log" > "$OUT/kernels.jsonl"
  REPEAT=1 bash "$0" compare "${2:?usage: gpu_check.sh kvtiles DIR}"
  bench --workload w1 --system engine --kv-cache-dtype fp8 --max-num-seqs 512 | cut -c1-400
  bench --workload w2 --system engine --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 1024 \
    | cut -c1-400
elif [ "$phase" = next ]; then  # before/after for hot-path commits: L1 from trees OLD and
  # LANDED and this one, W1 from OLD and this one (one pass each, alternating)
  old="${2:?usage: gpu_check.sh next OLD LANDED}"; landed="${3:?usage: gpu_check.sh next OLD LANDED}"
  for tree in "$old" "$landed" "$PWD"; do
    TREE_TIMEOUT=200 tree_bench "$tree" --workload l1 | cut -c1-300
  done
  for tree in "$old" "$PWD"; do TREE_TIMEOUT=200 tree_bench "$tree" --workload w1 | cut -c1-300; done
  if [ "${SPEC:-1}" != 0 ]; then  # then the verify-step bench (its engines' plans recorded)
    timeout "${SPEC_TIMEOUT:-280}" python3 -m scripts.bench_spec_decode gpu --shape llama2-7b \
      --batches 1 2>>"$OUT/bench.log" | tee "$OUT/spec_decode.jsonl" | cut -c1-300
  fi
elif [ "$phase" = l1formats ]; then  # L1 in bf16 (two passes), GPTQ int4 and FP8 from tree
  # DIR and from this one, alternating
  other="${2:?usage: gpu_check.sh l1formats DIR}"
  for q in "" "--quantization gptq-int4" "--quantization fp8"; do
    for tree in "$other" "$PWD"; do
      TREE_TIMEOUT=150 tree_bench "$tree" --workload l1 $q $([ -z "$q" ] && echo --repeat 2) \
        | grep -o '"tree": "[^"]*"\|"quantization": [^,]*\|"ms_per_token": [^,]*' | paste -sd' '
    done
  done
elif [ "$phase" = nsample ]; then  # parallel sampling: n = 8 against 8 separate requests
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine/test_gpu_engine.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 4
  bench --workload w1 --system engine --num-requests 64 --n 8
  bench --workload w1 --system engine --num-requests 64 --n 8 --n-as-requests
elif [ "$phase" = quant ]; then  # quantized kernels and models on the GPU, then L1/W1 per format
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_quant_linear.py \
    tests/models/quantization 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 6
  bench --workload l1 --system engine --quantization gptq-int4 --profile-steps 4
  bench --workload l1 --system engine --quantization gptq-int8
  if [ "${2:-}" != quick ]; then
    bench --workload w1 --system engine --quantization gptq-int4
    bench --workload l1 --system engine --quantization awq-int4
  fi
  python3 scripts/bench_kernels.py --only quant 2>>"$OUT/bench.log" | tee "$OUT/kernels.jsonl" \
    | tail -n 8
elif [ "$phase" = fp8 ]; then  # FP8 weights and KV cache: GPU tests, then L1/W1/W2 beside bf16
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_fp8_linear.py \
    tests/asyncengine_kernels/test_kv_cache_write.py tests/asyncengine_kernels/test_rotary_kv_cache.py \
    tests/asyncengine_kernels/test_paged_attention.py tests/asyncengine_kernels/test_rotary_paged_attention.py \
    tests/asyncengine_kernels/test_quant_linear.py tests/asyncengine/test_kv_cache_dtype.py \
    tests/models/quantization/test_fp8.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 12
  bench --workload l1 --system engine --quantization fp8
  bench --workload l1 --system engine --quantization gptq-int4
  bench --workload w1 --system engine
  bench --workload w1 --system engine --kv-cache-dtype fp8
  bench --workload w1 --system engine --kv-cache-dtype fp8 --max-num-seqs 512
elif [ "$phase" = fp8speed ]; then  # FP8 KV: attention GPU tests, decode sweep, W1 and W2
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_paged_attention.py \
    tests/asyncengine_kernels/test_rotary_paged_attention.py tests/asyncengine/test_kv_cache_dtype.py \
    tests/models/quantization/test_fp8.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 6
  python3 scripts/bench_kernels.py --only kvfp8 2>>"$OUT/bench.log" | tee "$OUT/kvfp8.jsonl" \
    | python3 -c "import json,sys; [print(r.get('workload'), r.get('kv'), {k: r[k] for k in ('TILE','num_warps','num_stages','KV_DOT_F16') if k in r}, r.get('ms'), r.get('frac_hbm'), r.get('error','')) for r in map(json.loads, sys.stdin)]"
  bench --workload w1 --system engine --kv-cache-dtype fp8 --max-num-seqs "${2:-512}"
  bench --workload w1 --system engine
  bench --workload w2 --system engine --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs "${2:-512}"
elif [ "$phase" = attn ]; then  # attention kernels: GPU tests, prefill bench, W1 both KV dtypes
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_paged_attention.py \
    tests/asyncengine_kernels/test_rotary_paged_attention.py tests/asyncengine_kernels/test_prefill_attention.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 4
  python3 scripts/bench_kernels.py --only prefill 2>>"$OUT/bench.log" | tee "$OUT/prefill.jsonl" \
    | tail -n 3
  bench --workload w1 --system engine --kv-cache-dtype fp8 --max-num-seqs "${2:-512}"
  bench --workload w1 --system engine
elif [ "$phase" = prefill ]; then  # the Gluon prefill kernel: GPU tests (its own, attention,
  # engine greedy vs HF, CUDA graphs), the prefill bench, W1 and L1 with it and without, W2
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_prefill_attention_hopper.py \
    tests/asyncengine_kernels/test_prefill_attention.py tests/asyncengine_kernels/test_paged_attention.py \
    tests/asyncengine/test_gpu_engine.py tests/asyncengine/test_cuda_graphs.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 6
  python3 scripts/bench_kernels.py --only prefill --no-prefill-sweep 2>>"$OUT/bench.log" \
    | tee "$OUT/prefill.jsonl" | tail -n 2
  for hopper in 1 0; do
    echo "{\"hopper_prefill\": $hopper}" | tee -a "$OUT/results.jsonl"
    flag=$([ "$hopper" = 0 ] && echo --no-hopper-prefill)
    bench --workload w1 --system engine $flag
    bench --workload l1 --system engine --profile-steps 2 $flag
  done
  bench --workload w2 --system engine
elif [ "$phase" = kvw ]; then  # W1 with FP8 KV beside bf16, W2 with FP8 weights + KV beside bf16
  bench --workload w1 --system engine --kv-cache-dtype fp8 --max-num-seqs "${2:-512}"
  bench --workload w1 --system engine
  bench --workload w2 --system engine --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs "${2:-512}"
  bench --workload w2 --system engine
elif [ "$phase" = bigbatch ]; then  # decode graphs past 512 sequences: GPU tests, then W2 with
  # FP8 weights and KV at each max_num_seqs given (default 512 1024), 1000 requests
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine/test_cuda_graphs.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 4
  for seqs in ${2:-512 1024}; do
    bench --workload w2 --system engine --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs "$seqs"
  done
elif [ "$phase" = w2 ]; then  # W2 in bf16 and with FP8 weights and KV cache
  bench --workload w2 --system engine --quantization fp8 --kv-cache-dtype fp8 ${2:+--max-num-seqs $2}
  bench --workload w2 --system engine
elif [ "$phase" = pairs ]; then  # one-row GEMVs in half-precision pairs: GPU tests, kernels, L1
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_half_pairs.py \
    tests/asyncengine_kernels/test_quant_linear.py tests/asyncengine_kernels/test_fp8_linear.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 6
  timeout 150 python3 scripts/bench_kernels.py --only quant 2>>"$OUT/bench.log" \
    | tee "$OUT/quant_kernels.jsonl" | tail -n 3
  bench --workload l1 --system engine --quantization gptq-int4 --profile-steps 4
  bench --workload l1 --system engine --quantization gptq-int8
  bench --workload l1 --system engine --quantization fp8 --profile-steps 4
elif [ "$phase" = gemv ]; then  # one-row quantized GEMVs: GPU tests, kernels (1 row), then L1
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_quant_linear.py 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -n 4
  python3 scripts/bench_kernels.py --only quant --quant-rows 1 2>>"$OUT/bench.log" \
    | tee "$OUT/quant_kernels.jsonl" | python3 scripts/best_kernels.py
  if [ "${2:-}" != kernels ]; then
    bench --workload l1 --system engine --quantization gptq-int4 --profile-steps 4
    bench --workload l1 --system engine --quantization gptq-int8
  fi
elif [ "$phase" = fp8row ]; then  # FP8 one-row GEMVs (whole-row, pairs): tests, kernels, L1
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine_kernels/test_gemv.py \
    tests/models/quantization/test_fp8.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 4
  python3 scripts/bench_kernels.py --only fp8row 2>>"$OUT/bench.log" \
    | tee "$OUT/fp8row_kernels.jsonl" | python3 scripts/best_kernels.py
  bench --workload l1 --system engine --quantization fp8 --profile-steps 4
  bench --workload l1 --system engine
elif [ "$phase" = eval ]; then  # prompt logprobs on the GPU, then Q1 through the engine's kernels
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine/test_prompt_logprobs.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 4
  python3 scripts/eval_quant.py --device cuda --fp8 --kv-cache-dtype fp8 \
    --kv-scales default,one,head \
    --rtn gptq-4-g64,gptq-8-g64,awq-4-g64,compressed-tensors-4-g64,compressed-tensors-8-channel,fp8-tensor \
    2>>"$OUT/bench.log" | tee "$OUT/q1.txt" | tail -n 30
elif [ "$phase" = structured ]; then  # issue #31: constrained decoding on the GPU, its cost
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine/structured_outputs \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 6
  bench --workload w1 --system engine --structured-outputs json
  bench --workload w1 --system engine --structured-outputs json --sync
elif [ "$phase" = int4 ]; then  # the wgmma matmul: its GPU tests, then kernel against
  # kernel at 1-64 rows on the 7B layers (bf16 cuBLAS, tinygemm, the Triton kinds)
  wgmma_kernels | cut -c1-260
elif [ "$phase" = int4l1 ]; then  # the wgmma kind in the engine: GPU tests, kernels, then L1
  # in GPTQ int4 (and int8 with BITS="4 8") from DIR and from this tree (each with its plans)
  other="${2:?usage: gpu_check.sh int4l1 DIR}"
  wgmma_kernels > /dev/null
  for bits in ${BITS:-4}; do
    for tree in "$other" "$PWD"; do
      TREE_TIMEOUT=240 tree_bench "$tree" --workload l1 --quantization "gptq-int$bits" \
        | grep -o '"tree": "[^"]*"\|"quantization": [^,]*\|"ms_per_token": [^,]*' | paste -sd' '
    done
  done
  if [ -n "${W1:-}" ]; then  # W1=1: then W1 in each GPTQ width and in bf16 from this tree
    for q in $(for b in ${BITS:-4}; do echo "gptq-int$b"; done) ""; do
      bench --workload w1 --system engine ${q:+--quantization $q} | cut -c1-300
    done
  fi
elif [ "$phase" = draftkv ]; then  # pinned uploads, the draft proposer, plans before the
  # memory profile: their GPU tests; the draft's cost per proposal; the verify step's and the
  # one-token step's kernels, L1 at acceptance 0.7; a cold GPTQ int4 start (empty caches);
  # L1/W1 in bf16 and W1 in GPTQ int8 from DIR and from this tree. PARTS picks some of
  # "tests draft spec nopdl compare" (default: all but nopdl), so that a call fits its time
  # limit; nopdl: the verify-step bench with ASYNCENGINE_NO_PDL=1, for its kernel profile.
  other="${2:?usage: gpu_check.sh draftkv DIR}"
  parts="${PARTS:-tests draft spec compare}"
  if [[ " $parts " == *" tests "* ]]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/asyncengine/test_host_staging.py tests/asyncengine/spec_decode/test_draft_model.py \
      tests/asyncengine_kernels/test_pdl.py ${GRAPH_TESTS-tests/asyncengine/test_cuda_graphs.py} \
      2>&1 | tee "$OUT/gpu_tests.log" | tail -n 6
  fi
  if [[ " $parts " == *" draft "* ]]; then
    timeout 120 python3 -m scripts.bench_spec_decode draft 2>>"$OUT/bench.log" \
      | tee "$OUT/spec_draft.jsonl" | cut -c1-300
  fi
  if [[ " $parts " == *" spec "* ]]; then
    timeout 200 python3 -m scripts.bench_spec_decode gpu --shape llama2-7b --batches 1 \
      --sweep 4:0.7 6:0.7 2>>"$OUT/bench.log" | tee "$OUT/spec_decode.jsonl" | cut -c1-1500
  fi
  if [[ " $parts " == *" nopdl "* ]]; then  # a verify step's and a one-token step's kernels
    # without programmatic dependent launch, whose overlap otherwise double counts them
    ASYNCENGINE_NO_PDL=1 timeout 200 python3 -m scripts.bench_spec_decode gpu --shape llama2-7b \
      --batches 1 --sweep 4:0.7 2>>"$OUT/bench.log" | tee "$OUT/spec_nopdl.jsonl" | cut -c1-1500
  fi
  if [[ " $parts " == *" compare "* ]]; then
    ASYNCENGINE_CACHE=/tmp/cold-cache TRITON_CACHE_DIR=/tmp/cold-triton timeout 150 \
      python3 scripts/bench_throughput.py --workload l1 --system engine --quantization gptq-int4 \
      2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl" | cut -c1-300
    for w in l1 w1; do
      for tree in "$other" "$PWD"; do
        TREE_TIMEOUT=150 tree_bench "$tree" --workload "$w" | cut -c1-300
      done
    done
    for tree in "$other" "$PWD"; do
      TREE_TIMEOUT=150 tree_bench "$tree" --workload w1 --quantization gptq-int8 | cut -c1-300
    done
  fi
elif [ "$phase" = recheck ]; then  # after the quantization refactors (linear methods, the
  # config split, the format as a constructor argument): their GPU tests and an L1 start in
  # every weight format; the int8 ring beside the whole slice; the verify-step bench; L1/W1
  # from DIR and here; W2 with FP8 weights and KV at 3,000 requests; the CUDA-core MHA
  # decode tiles. PARTS picks some of "wgtests tests admit runs formats fp16 cold int8 int4 ncu qw1
  # split spec draft attn kvsweep fp8kv compare w2" (default: wgtests tests formats int8 spec), so a call
  # fits its limit; FORMATS narrows
  # "formats"; "admit": W1 at a ceiling of 1,024 with room kept for growth against the
  # figures' settings (ADMIT_W2=1: W2 FP8 at 1,024 with and without the room).
  other="${2:?usage: gpu_check.sh recheck DIR}"
  parts="${PARTS:-wgtests tests formats int8 spec}"
  if [[ " $parts " == *" wgtests "* ]]; then  # the wgmma GPU tests alone (fp16, groups of 32
    # and 64 compile many variants)
    # WG_K: a pytest -k expression that picks some of them
    timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu --maxfail=20 \
      ${WG_K:+-k "$WG_K"} -rf tests/asyncengine_kernels/test_quant_wgmma.py \
      tests/models/quantization/test_kinds.py \
      2>&1 | tee "$OUT/gpu_wgmma_tests.log" | tail -n 12
  fi
  if [[ " $parts " == *" tests "* ]]; then  # the other quantization and speculative GPU tests
    # (TEST_PATHS: other test paths instead)
    timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu \
      ${TEST_PATHS:-tests/models/quantization tests/asyncengine/spec_decode tests/asyncengine/test_prelaunch.py} \
      --deselect tests/models/quantization/test_kinds.py 2>&1 | tee "$OUT/gpu_tests.log" \
      | tail -n 6
  fi
  if [[ " $parts " == *" split "* ]]; then  # decode graphs split after a head of layers:
    # greedy output equal to HF, plain and speculating; the engine GPU tests beside them
    timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/asyncengine/test_gpu_engine.py 2>&1 | tee "$OUT/gpu_split_tests.log" | tail -n 6
  fi
  if [[ " $parts " == *" admit "* ]]; then  # a ceiling of 1,024 sequences (vLLM's default on
    # the H200) with room kept for growth at admission, against the settings of the figures
    # of record: W1 at 256 in bf16 and at 512 over an FP8 cache, no room kept
    bench --workload w1 --system engine --max-num-seqs 1024 | cut -c1-400
    bench --workload w1 --system engine --max-num-seqs 256 --schedule-conservativeness 0 \
      | cut -c1-400
    bench --workload w1 --system engine --kv-cache-dtype fp8 --max-num-seqs 1024 | cut -c1-400
    bench --workload w1 --system engine --kv-cache-dtype fp8 --max-num-seqs 512 \
      --schedule-conservativeness 0 | cut -c1-400
    if [ -n "${ADMIT_W2:-}" ]; then  # W2 with FP8 weights and KV at 1,024, with room and without
      for c in 1 0; do
        bench --workload w2 --system engine --quantization fp8 --kv-cache-dtype fp8 \
          --max-num-seqs 1024 --schedule-conservativeness "$c" | cut -c1-400
      done
    fi
  fi
  if [[ " $parts " == *" formats "* ]]; then
    for q in ${FORMATS:-gptq-int4 gptq-int8 awq-int4 ct-w4a16 fp8}; do
      bench --workload l1 --system engine --quantization "$q" | cut -c1-300
    done
  fi
  if [[ " $parts " == *" fp16 "* ]]; then  # fp16 activations, which most GPTQ and AWQ
    # checkpoints declare: L1 in each integer format in fp16, then in bf16, since the wgmma
    # matmul serves both (and groups of 32 and 64): the int4 kernels at 1-128 rows in fp16,
    # groups of 128 and 64 (fp16 cuBLAS beside them), then the engines
    for g in 128 64; do
      timeout 100 python3 scripts/bench_kernels.py --only int4 --quant-dtype float16 \
        --quant-group "$g" --quant-rows 1 8 32 128 2>>"$OUT/bench.log" \
        | tee -a "$OUT/fp16_kernels.jsonl" | cut -c1-260
    done
    for q in ${FP16_FORMATS:-gptq-int4 gptq-int8}; do
      for dt in float16 bfloat16; do
        bench --workload l1 --system engine --quantization "$q" --dtype "$dt" | cut -c1-300
      done
    done
  fi
  if [[ " $parts " == *" cold "* ]]; then  # a cold GPTQ int4 start (empty compile and plan
    # caches; target 30 s) in bf16, then in fp16 (its own kernels to compile); COLD_BF16=1:
    # then a cold start with bf16 weights
    starts=("--quantization gptq-int4 --dtype bfloat16" "--quantization gptq-int4 --dtype float16")
    [ -n "${COLD_BF16:-}" ] && starts+=("--dtype bfloat16")
    for flags in "${starts[@]}"; do
      rm -rf /tmp/cold-cache /tmp/cold-triton
      ASYNCENGINE_CACHE=/tmp/cold-cache TRITON_CACHE_DIR=/tmp/cold-triton timeout 150 \
        python3 scripts/bench_throughput.py --workload l1 --system engine $flags \
        2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl" | cut -c1-300
    done
  fi
  if [[ " $parts " == *" int8 "* ]]; then
    timeout 200 python3 scripts/bench_kernels.py --only int8 --quant-rows 32 64 128 256 \
      2>>"$OUT/bench.log" | tee "$OUT/int8_kernels.jsonl" | cut -c1-260
  fi
  if [[ " $parts " == *" int4 "* ]]; then  # the int4 kernels at 64, 128 and 256 rows (INT4_ROWS)
    timeout 200 python3 scripts/bench_kernels.py --only int4 --quant-rows ${INT4_ROWS:-64 128 256} \
      2>>"$OUT/bench.log" | tee "$OUT/int4_kernels.jsonl" | cut -c1-260
  fi
  if [[ " $parts " == *" runs "* ]]; then  # RUNS: engine runs' flags, one run per ';', each
    # optionally led by NAME=VALUE environment settings; TREE=DIR runs it from tree DIR
    IFS=';' read -r -a runs <<< "${RUNS:?PARTS=runs needs RUNS}"
    for r in "${runs[@]}"; do
      read -r -a words <<< "$r"
      settings=(); tree=.
      while [[ ${#words[@]} -gt 0 && ${words[0]} =~ ^[A-Z_]+= ]]; do
        if [[ ${words[0]} == TREE=* ]]; then tree="${words[0]#TREE=}"
        else settings+=("${words[0]}"); fi
        words=("${words[@]:1}")
      done
      echo "== run: $r"
      (export PYTHONPATH="${PYTHONPATH/$PWD/$(cd "$tree" && pwd)}"; cd "$tree" \
        && env "${settings[@]}" python3 scripts/bench_throughput.py --system engine \
        "${words[@]}" 2>>"$OUT/bench.log") | sed "s|^{|{\"run\": \"$r\", |" \
        | tee -a "$OUT/results.jsonl" | cut -c1-400
    done
  fi
  if [[ " $parts " == *" ncu "* ]]; then  # Nsight Compute on the int4 wgmma matmul and bf16
    # cuBLAS at 128 and 256 rows (gate/up, down): tensor-pipe and L2 use, warp stalls
    ncu --query-metrics 2>&1 | grep -i -E 'gmma|tensor_op' > "$OUT/ncu_metric_names.txt" || true
    timeout 300 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats \
      python3 scripts/profile_wgmma.py --rows 128 256 > "$OUT/ncu_wgmma.txt" 2>&1
    grep -E '^\{|Duration|Throughput|Pipe|Stall|Warp Cycles|Occupancy|Registers|Shared Memory' \
      "$OUT/ncu_wgmma.txt" | head -n 150
  fi
  if [[ " $parts " == *" qw1 "* ]]; then  # W1 in bf16, GPTQ int4 and int8
    for q in none gptq-int4 gptq-int8; do
      flag=$([ "$q" = none ] || echo "--quantization $q")
      bench --workload w1 --system engine $flag | cut -c1-300
    done
  fi
  if [[ " $parts " == *" spec "* ]]; then  # SPEC_RUNS: the verify-step bench once per ';'
    # (flags, optionally led by TREE=DIR to run it from tree DIR); default: this tree as is.
    # "--brief" in a run's flags: the swept draft counts' verify steps and the sweep only
    # (an A/B in a short call); "--graph-head-layers 0 2 4": one speculating engine per
    # value beside one reference engine (SPEC_S: seconds a run may take, 200 by default)
    runs=("")
    [ -n "${SPEC_RUNS:-}" ] && IFS=';' read -r -a runs <<< "$SPEC_RUNS"
    for r in "${runs[@]}"; do
      read -r -a words <<< "$r"; tree=.
      if [[ ${words[0]:-} == TREE=* ]]; then tree="${words[0]#TREE=}"; words=("${words[@]:1}"); fi
      echo "== spec run: $r"
      (export PYTHONPATH="${PYTHONPATH/$PWD/$(cd "$tree" && pwd)}"; cd "$tree" \
        && timeout "${SPEC_S:-200}" python3 -m scripts.bench_spec_decode gpu --shape llama2-7b --batches 1 \
        --sweep 4:0.7 "${words[@]}" 2>>"$OUT/bench.log") | sed "s|^{|{\"run\": \"$r\", |" \
        | tee -a "$OUT/spec_decode.jsonl" | cut -c1-1500
    done
  fi
  if [[ " $parts " == *" draft "* ]]; then  # the draft model's cost per proposal, its small
    # graphs whole and split after two layers (DRAFT_ARGS: other flags)
    timeout 400 python3 -m scripts.bench_spec_decode draft --batches 1 8 \
      --graph-head-layers 0 2 --no-eager ${DRAFT_ARGS:-} 2>>"$OUT/bench.log" \
      | tee "$OUT/draft.jsonl" | cut -c1-400
  fi
  if [[ " $parts " == *" attn "* ]]; then
    # The decode tiles' GPU tests: the CUDA-core ones and every FP8-cache case (the other
    # attention variants build to the machine code their tests last passed with:
    # `compile_kernels.py --sass-digest`).
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -k "cuda_cores or fp8" \
      tests/asyncengine_kernels/test_paged_attention.py 2>&1 \
      | tee "$OUT/gpu_attn_tests.log" | tail -n 6
  fi
  if [[ " $parts " == *" kvsweep "* ]]; then
    timeout 200 python3 scripts/bench_kernels.py --only kvfp8 2>>"$OUT/bench.log" \
      | tee "$OUT/kvfp8.jsonl" | cut -c1-260
  fi
  both_trees() {  # "WORKLOADS" ARGS...: each workload from DIR, then from here
    local w tree
    for w in $1; do
      for tree in "$other" "$PWD"; do
        TREE_TIMEOUT=150 tree_bench "$tree" --workload "$w" "${@:2}" | cut -c1-300
      done
    done
  }
  if [[ " $parts " == *" fp8kv "* ]]; then  # L1 and W1 over an FP8 KV cache
    both_trees "${FP8KV_WORKLOADS:-l1 w1}" --kv-cache-dtype fp8 --max-num-seqs 512
  fi
  if [[ " $parts " == *" compare "* ]]; then  # COMPARE_ARGS: flags for both trees' runs
    both_trees "l1 w1" ${COMPARE_ARGS:-}
  fi
  if [[ " $parts " == *" w2 "* ]]; then  # W2_ARGS: more flags (--schedule-conservativeness 0)
    bench --workload w2 --system engine --quantization fp8 --kv-cache-dtype fp8 \
      --max-num-seqs 1024 --num-requests 3000 ${W2_ARGS:-} | cut -c1-400
  fi
elif [ "$phase" = tp ]; then  # needs a machine with several GPUs
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine/test_tensor_parallel.py \
    2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -n 8
  python3 scripts/bench_tp.py 2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl"
else
  echo "unknown phase: $phase (check, bench, compare DIR, l1formats DIR, house DIR, capabilities DIR, serving, router, longmix, nsample, qgemm, qw1, stage, kvprof, kvtiles DIR, next, quant, fp8, fp8speed, attn, prefill, kvw, bigbatch, w2, spec, rows, probe, tuning, session, pairs, gemv, fp8row, eval, structured, int4, int4l1 DIR, draftkv DIR, recheck DIR, tp)" >&2; exit 2
fi
tail -n 40 "$OUT/bench.log" > "$OUT/bench_tail.log"
echo "== results"; cat "$OUT/results.jsonl" 2>/dev/null | cut -c1-400
echo "== serving"; cut -c1-300 "$OUT/serving.jsonl" 2>/dev/null
echo "== compare"; cat "$OUT/compare.jsonl" 2>/dev/null | cut -c1-300
echo "== longmix"; grep "^|" "$OUT/longmix.txt" 2>/dev/null || true
