#!/usr/bin/env bash
# Every GPU check of the open issues in one command, for a session lent a GPU machine (which has
# torch and transformers but not this project's serving extras):
#
#   bash benchmarks/gpu_all.sh                      # all pieces, within GPU_BUDGET_S seconds
#   GPU_PIECES="training serving" bash benchmarks/gpu_all.sh
#   GPU_TRAINING_ROWS="tetrad-bf16-compiled tetrad-fp8-compiled" bash benchmarks/gpu_all.sh
#
# Pieces, in this order (the ones the open issues need most first): env (versions), quant
# (tests/gpu/test_gpu_quantization.py and test_gpu_offload.py: issue 30's int8/int4 CUDA kernels
# and fp8 KV pool, a closed engine's memory free for the next, issue 31's offload on a GPU),
# kernels (tests/test_triton_attention.py and test_triton_engine.py on CUDA), attention
# (benchmarks/gpu_triton_attention.py), serving (benchmarks/gpu_serving.py on the Triton backend,
# 16-token blocks: issue 29's GPU check is these three), quantspeed
# (benchmarks/gpu_quant_decode.py), tests (the other tests/gpu files and the varlen kernel test),
# fp8 (benchmarks/gpu_fp8_matmul.py), training (benchmarks/gpu_training.py), calibrate
# (`tetrad calibrate --device cuda`). Each runs under its own time limit, cut to what is left of
# the budget (issue 29's three fill the default one), and a piece that fails or runs out of time
# does not stop the next. Everything printed goes to $OUT/gpu_all.log; the JSON files land
# beside it.
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
LOG=$OUT/gpu_all.log
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
PIECES=${GPU_PIECES:-env quant kernels attention serving quantspeed tests fp8 training calibrate}
deadline=$((SECONDS + ${GPU_BUDGET_S:-450}))

piece() {  # piece NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 left=$((deadline - SECONDS)) started=$SECONDS
    shift 2
    [[ " $PIECES " == *" $name "* ]] || return 0
    if ((left < 20)); then
        echo "== $name: not run, ${left} s of the budget left" | tee -a "$LOG"
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit} s): $*" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "== $name: exit status ${PIPESTATUS[0]} after $((SECONDS - started)) s" | tee -a "$LOG"
}

piece env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm \
    --format=csv && $PYTHON -c 'import torch, transformers, triton; print(\"torch\", \
    torch.__version__, \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__, \
    \"triton\", triton.__version__)'"
piece quant 100 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_quantization.py \
    tests/gpu/test_gpu_offload.py
piece kernels 100 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
    tests/test_triton_engine.py
piece attention 70 "$PYTHON" benchmarks/gpu_triton_attention.py --out "$OUT"
# Its results land in $OUT/gpu_serving.json as they come; HF's continuous batching, last, is the
# part a cut run loses.
piece serving 170 "$PYTHON" benchmarks/gpu_serving.py --block-size 16 --attention triton \
    --out "$OUT"
piece quantspeed 60 "$PYTHON" benchmarks/gpu_quant_decode.py --out "$OUT"
piece tests 60 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py \
    tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_training.py \
    tests/test_paged_attention.py::test_varlen_reads_the_pool_in_place_like_gathered_attention
piece fp8 40 "$PYTHON" benchmarks/gpu_fp8_matmul.py
# shellcheck disable=SC2086  # the rows are words
piece training 420 "$PYTHON" benchmarks/gpu_training.py --row-timeout 110 --warmup 3 --steps 8 \
    ${GPU_TRAINING_ROWS:+--rows $GPU_TRAINING_ROWS}
piece calibrate 90 "$PYTHON" -m tetrad calibrate --device cuda --out "$OUT/gpu_profile.json"
echo "== done after $SECONDS s" | tee -a "$LOG"
