#!/usr/bin/env bash
# The GPU checks in one command, for a CUDA machine with torch, lightning and triton installed:
#   bash benchmarks/gpu_check.sh [test|bench|all] [OUT_DIR]
# test:  machine facts and tests/test_cuda.py (native GEMMs, compiled Triton casts, sync-free steps, Trainer fits);
# bench: the Llama3-8B-shaped stack (benchmarks/bench_llama.py --sizes llama3-8b): every variant eager, and compiled
#        bf16, torchao tensorwise/rowwise and our per-tensor and row-wise recipes, within a compile budget.
# Sizing (H200, torch 2.11, 2026-11-26): test 121 s; bench 300 s when the compile budget of 250 s stopped before
# compiled `delayed` (253 s spent on bf16, torchao tensorwise/rowwise, ours tensorwise/rowwise, the whole stack
# compiled). The bench now compiles block by block (--compile-scope blocks, torchtitan's way): the blocks after the
# first share one graph, so each variant compiles two blocks' graphs instead of four (unmeasured on a GPU so far).
# Each compiled variant's gradients are checked against its eager twin's before it is timed (bench_llama.py).
# Logs, the result JSON and the plot go to OUT_DIR (default benchmarks/results/gpu). Wheels in .whl/ (e.g. torchao,
# where the machine lacks it) are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
out=${2:-benchmarks/results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [[ $what == test || $what == all ]]; then
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
        python3 -c "import torch, lightning, triton, torchao; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'lightning', lightning.__version__, 'triton', triton.__version__, 'torchao', torchao.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
    } 2>&1 | grep -v "Failed to load\|register_constant" | tee "$out/env.txt"
    timeout "${TEST_TIMEOUT:-150}" python3 -m pytest tests/test_cuda.py -q -rs -p no:cacheprovider --durations=8 -s 2>&1 \
        | grep -v "Failed to load" | tee "$out/test_cuda.log" | grep -E "passed|failed|error|FAILED|ERROR|native vs|SKIP" | tail -40
fi
if [[ $what == bench || $what == all ]]; then
    # mxfp8 is left out: its GEMMs are native on compute capability 10.0+ only (emulated, slower than bf16, before)
    kinds=bf16,torchao-tensorwise,torchao-rowwise,ours-tensorwise,ours-delayed,ours-rowwise,ours-blockwise
    [[ $(python3 -c "import torch; print(torch.cuda.get_device_capability()[0] >= 10)") == True ]] && kinds+=,ours-mxfp8
    timeout "${BENCH_TIMEOUT:-430}" python3 benchmarks/bench_llama.py --sizes "${SIZES:-llama3-8b}" --kinds "$kinds" \
        --compile-kinds bf16,torchao-tensorwise,ours-tensorwise,ours-rowwise,ours-delayed,torchao-rowwise \
        --compile-budget "${COMPILE_BUDGET:-300}" --compile-scope "${COMPILE_SCOPE:-blocks}" --cold-compile --reps "${REPS:-7}" --json "$out/llama_gpu.json" --plot "$out/llama_gpu.png" \
        > "$out/bench.log" 2>&1
    echo "benchmark exit $?"; grep -v "Failed to load" "$out/bench.log" | tail -60
fi
