#!/usr/bin/env bash
# headroom's accelerator checks, in one go, on a machine with a GPU and a PyTorch that sees it:
#   1. the `gpu`-marked tests, then every test parametrized over devices on the accelerator;
#   2. the race tests again under PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1);
#   3. the GPU benchmarks (each checks its results against plain PyTorch before timing).
# Each stage has a time limit, so one stage that hangs does not hide the others' results. Logs
# and JSON go to LOGDIR (default benchmarks/results/gpu_logs); the summary is printed last.
#
#     benchmarks/gpu_check.sh [tests|bench|all|quick] [LOGDIR]   # PY=python3 by default
#
# quick (limits: 150 s for the tests, which took 54 s on the H100; LLM_BUDGET=270 s + 60 s for
# the benchmark; not yet run on a GPU): the `gpu`-marked tests, then llm_finetune's 1B
# row for torchao and headroom with its gradients summed on the device and in host memory
# (headroom_store), the A/B of the last change, with the sampled stacks of every thread.
#
# PEERS=DIR puts a folder of peers' packages (e.g. torchtune or torchao, installed with
# pip --target) on the benchmarks' path only, never the tests'. LLM_BUDGET sets the seconds
# benchmarks/llm_finetune.py may take (480 by default).
set -u
PY=${PY:-python3}
WHAT=${1:-all}
LOG=${2:-benchmarks/results/gpu_logs}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
summary=()

stage() {  # stage NAME SECONDS COMMAND...: runs COMMAND with a time limit, logs it, records rc
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-4s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E '(passed|failed|error)' "$LOG/$name.log" | tail -1)")")
}

# The package: an editable install without network, else the sources on PYTHONPATH.
if ! $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$LOG/install.log" 2>&1
then
  $PY setup.py build_ext --inplace >>"$LOG/install.log" 2>&1
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi -L; $PY -c 'import torch, headroom; print("torch", torch.__version__,
  torch.cuda.get_device_name(), "headroom", headroom.__file__)'; } >"$LOG/env.log" 2>&1
cat "$LOG/env.log"

T=${T:-1}  # scales every limit below
PYTEST=($PY -m pytest -q -p no:cacheprovider -o addopts= -ra --timeout 120)
if [[ $WHAT == quick ]]; then
stage tests_gpu $((150 * T)) "${PYTEST[@]}" -m gpu --junitxml="$LOG/tests_gpu.xml"
[[ -n ${PEERS:-} ]] && export PYTHONPATH=$PEERS${PYTHONPATH:+:$PYTHONPATH}
LLM_BUDGET=${LLM_BUDGET:-$((270 * T))}
stage bench_llm_finetune $((LLM_BUDGET + 60)) $PY benchmarks/llm_finetune.py \
  --tools torchao,headroom,headroom_store --sizes 1b --steps 3 --budget-s "$LLM_BUDGET" \
  --trace-dir "$LOG" --out "$LOG/llm_finetune_gpu.json"
elif [[ $WHAT != bench ]]; then
stage tests_gpu $((200 * T)) "${PYTEST[@]}" -m gpu --junitxml="$LOG/tests_gpu.xml"
stage tests_on_device $((120 * T)) "${PYTEST[@]}" -m "not gpu and not slow" -k "cuda" \
  --junitxml="$LOG/tests_on_device.xml"
stage tests_sanitizer $((120 * T)) env TORCH_CUDA_SANITIZER=1 "${PYTEST[@]}" -m gpu \
  tests/residency/test_offload_gpu_races.py tests/transfer tests/store tests/optim
fi
if [[ $WHAT != tests && $WHAT != quick ]]; then
[[ -n ${PEERS:-} ]] && export PYTHONPATH=$PEERS${PYTHONPATH:+:$PYTHONPATH}
stage bench_offload_overhead $((120 * T)) $PY benchmarks/offload_overhead_gpu.py --repeats 5 \
  --out "$LOG/offload_overhead_gpu.json"
stage bench_activation_offload $((150 * T)) $PY benchmarks/activation_offload_gpu.py --repeats 3
cp benchmarks/results/activation_offload_gpu.json "$LOG/" 2>/dev/null
stage bench_huge_classifier $((150 * T)) $PY benchmarks/huge_classifier.py --device cuda \
  --repeats 3 --out "$LOG/huge_classifier_gpu.json"
stage bench_pinned_memory $((60 * T)) $PY benchmarks/pinned_memory.py \
  --out "$LOG/pinned_memory_gpu.json"
stage bench_compile_offload $((240 * T)) $PY benchmarks/compile_offload.py --device cuda \
  --d 1024 --layers 8 --batch 8 --seq 512 --vocab 8192 --out "$LOG/compile_offload_gpu.json"
stage bench_fsdp2_offload $((240 * T)) $PY benchmarks/fsdp2_offload_gpu.py --layers 8 \
  --out "$LOG/fsdp2_offload_gpu.json"
# Its own budget (LLM_BUDGET seconds) ends before the stage's limit: it writes its JSON, marked
# partial, whatever it got to.
LLM_BUDGET=${LLM_BUDGET:-$((480 * T))}
stage bench_llm_finetune $((LLM_BUDGET + 60)) $PY benchmarks/llm_finetune.py \
  --budget-s "$LLM_BUDGET" --trace-dir "$LOG" --out "$LOG/llm_finetune_gpu.json"
fi

grep -hE '^(FAILED|ERROR) ' "$LOG"/*.log | cut -c1-300 | head -60
printf '%s\n' "${summary[@]}" | tee "$LOG/summary.txt"
