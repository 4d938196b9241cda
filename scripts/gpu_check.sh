#!/usr/bin/env bash
# One call on a GPU machine: install what is missing, check correctness, then time.
#   bash scripts/gpu_check.sh check    # GPU tests (kernels at size, engine vs HF) + kernel bench
#   bash scripts/gpu_check.sh bench    # W1 / L1: engine and HF peers
#   bash scripts/gpu_check.sh w2       # W2: engine
#   bash scripts/gpu_check.sh final    # GPU tests, L1, W1, W2 (200 requests), S1
#   bash scripts/gpu_check.sh tp       # several GPUs: TP tests, TP=1/2/4/8 check and benchmarks
#   bash scripts/gpu_check.sh peers    # GPU tests, then W1 / L1 twice each and their HF peers
#   bash scripts/gpu_check.sh stop     # GEMV/PDL/engine GPU tests, the README table, W2, then
#                                      # a split-KV sweep of decode attention
#   bash scripts/gpu_check.sh table    # W1 / L1 twice each and their HF peers (no tests)
#   bash scripts/gpu_check.sh sched    # W1 under scheduling limits; S1 at low load and saturation
#   bash scripts/gpu_check.sh gemv     # batch-1 GEMV tests and kernels against BLAS, then L1
#   bash scripts/gpu_check.sh decode   # GEMV, attention and engine GPU tests, then L1 (also
#                                      # without the whole-row GEMV candidates) and the GEMVs
#   bash scripts/gpu_check.sh async    # GPU tests, then L1 / W1 with and without async scheduling
#                                      # and a per-kernel profile of decode and mixed steps
# Logs and JSON lines go to $OUT (or ./out) and a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 ASYNCENGINE_CACHE=/tmp/asyncengine-cache
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
serving() {  # S1 with W1's model and lengths
  python3 scripts/bench_serving.py --shape llama2-7b --device cuda --input-len 512 \
    --output-len 256 --skip-tokenizer-init --load-format dummy "$@" 2>>"$OUT/bench.log" \
    | tee -a "$OUT/serving.jsonl"
}
if [ "$phase" = check ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/asyncengine/test_gpu_engine.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
  python3 scripts/bench_kernels.py 2>>"$OUT/bench.log" | tee "$OUT/kernels.jsonl"
  bench --workload smoke --system engine
  bench --workload l1 --system engine
  bench --workload w1 --system engine --profile-steps 10
elif [ "$phase" = bench ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_rms_norm.py \
    tests/kernels/test_rotary.py 2>&1 | tee "$OUT/gpu_tests_norm_rotary.log" | tail -n 3
  bench --workload l1 --system engine
  bench --workload l1 --system engine --enforce-eager
  bench --workload w1 --system engine
  bench --workload l1 --system hf
  bench --workload w1 --system hf --hf-batch-size 128
elif [ "$phase" = tp ]; then  # needs a machine with several GPUs
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/asyncengine/test_tensor_parallel.py \
    2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -n 8
  python3 scripts/bench_tp.py 2>>"$OUT/bench.log" | tee -a "$OUT/results.jsonl"
elif [ "$phase" = async ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/asyncengine/test_gpu_engine.py \
    tests/asyncengine/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 8
  bench --workload l1 --system engine --profile-steps 20
  bench --workload l1 --system engine --sync
  bench --workload w1 --system engine --profile-steps 4
  bench --workload w1 --system engine --sync
elif [ "$phase" = sched ]; then  # W1 under scheduling limits, twice each; then S1
  bench --workload w1 --system engine --repeat 2 --max-num-seqs 512
  bench --workload w1 --system engine --repeat 2 --max-num-seqs 256
  bench --workload w1 --system engine --repeat 2 --max-num-seqs 512 --kv-growth-reserve-tokens 256
  serving --rates 0.5 --num-requests 16 --skip-offline
  serving --rates 16,inf --num-requests 256
elif [ "$phase" = peers ]; then  # GPU tests, then every figure of the README table with peers
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/asyncengine/test_gpu_engine.py \
    tests/asyncengine/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 8
  bench --workload l1 --system engine --repeat 2
  bench --workload w1 --system engine --repeat 2
  bench --workload l1 --system hf
  bench --workload w1 --system hf --hf-batch-size 128
elif [ "$phase" = gemv ]; then  # batch-1 GEMV: kernels against BLAS, then L1 end to end
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gemv.py \
    tests/asyncengine/test_gpu_engine.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 4
  python3 scripts/bench_kernels.py --only gemv 2>>"$OUT/bench.log" | tee "$OUT/kernels.jsonl"
  bench --workload l1 --system engine --repeat 2
elif [ "$phase" = decode ]; then  # batch-1 decode work: GEMV, attention and engine tests, L1
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gemv.py \
    tests/kernels/test_paged_attention.py tests/kernels/test_rotary_paged_attention.py \
    tests/asyncengine/test_gpu_engine.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 8
  bench --workload l1 --system engine --repeat 2
  ASYNCENGINE_WHOLE_ROW_GEMV=0 bench --workload l1 --system engine --repeat 2
  python3 scripts/bench_kernels.py --only gemv 2>>"$OUT/bench.log" | tee "$OUT/kernels.jsonl" \
    | tail -n 4
elif [ "$phase" = stop ]; then  # what a closing note reports, in one call
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gemv.py tests/kernels/test_pdl.py \
    tests/kernels/test_paged_attention.py tests/kernels/test_rotary_paged_attention.py \
    tests/asyncengine/test_gpu_engine.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 8
  bench --workload l1 --system engine --repeat 2
  bench --workload w1 --system engine --repeat 2
  bench --workload l1 --system hf
  bench --workload w1 --system hf --hf-batch-size 128
  bench --workload w2 --system engine
  # Split-KV counts at small batches and a short and a long context (kernel alone, eager).
  python3 scripts/bench_kernels.py --only sweep --sweep-batches 1,4 --sweep-contexts 640,4000 \
    --no-prefill-sweep 2>>"$OUT/bench.log" > "$OUT/sweep.jsonl"
elif [ "$phase" = table ]; then  # the README's W1 / L1 rows and their HF peers, no tests
  bench --workload l1 --system engine --repeat 2
  bench --workload w1 --system engine --repeat 2
  bench --workload l1 --system hf
  bench --workload w1 --system hf --hf-batch-size 128
elif [ "$phase" = w1 ]; then
  bench --workload w1 --system engine
elif [ "$phase" = w2 ]; then
  bench --workload w2 --system engine
elif [ "$phase" = final ]; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels tests/asyncengine/test_gpu_engine.py \
    tests/asyncengine/test_sampler.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 8
  bench --workload l1 --system engine
  bench --workload w1 --system engine
  bench --workload w2 --system engine --num-requests 200
  serving --rates 0.5 --num-requests 16 --skip-offline
  serving --rates 4,16,inf --num-requests 256
fi
tail -n 40 "$OUT/bench.log" > "$OUT/bench_tail.log"
echo "== results"; cat "$OUT/results.jsonl" 2>/dev/null | cut -c1-400
