#!/usr/bin/env bash
# One prepared GPU check that fits a short lease (at most about 9.5 minutes on one H200: each section has a
# time cap), printing one report as it goes:
#   1. pytest tests/ops on CUDA tensors with compiled kernels (fp32, bf16, fp16);
#   2. bench/kernels.py --check: every op against eager, Liger-Kernel and FlagGems, bf16 and fp32 rows,
#      attention at seq 8192 against PyTorch's flash SDPA;
#   3. end to end through the worker, model=1b (FSDP2 on one GPU, seq 2048, batch 16): tokens/s and MFU
#      for kernels=torch, kernels=triton (its default: the model's fused ops, the ATen ops routed during
#      the step and eval, ops.AdamW) and kernels=triton with kernels.exclude=[mm,addmm,bmm] (cuBLAS's
#      matmuls): which default is faster;
#   4. bench/e2e.py on model=1b and model=small: tokens/s of kernels=torch, kernels=triton,
#      flag_gems.enable() and transformers' Llama eager and with Liger's apply_liger_kernel_to_llama;
#   5. bench/gpu_report.py: the issue's targets, met or missed, from the report above.
# `bash bench/gpu_check.sh overhead` runs bench/step_overhead.py instead (the worker against a hand loop);
# `bash bench/gpu_check.sh checkpoint` runs bench/checkpoint.py (the stall of one save, sync against
# train.checkpoint_async=true, models small and 1b) instead.
# `bash bench/gpu_check.sh aten` runs bench/kernels.py --aten instead (at most about 5 minutes): each routed ATen
# op of the table (`python -m ops list`) that takes one or two tensors, reduces or scans, against eager and FlagGems.
# `bash bench/gpu_check.sh models` runs bench/models.py instead (a second call of at most about 5 minutes, as the
# report above fills one): per model family, tokens/s and peak memory of a training step, model.impl=native
# against model.impl=transformers, at the tiny and small shapes, the rows it prints on CPUs.
#
# Here, on a machine with PyPI (once):   bash bench/gpu_check.sh --prepare
#   downloads what the GPU machine lacks (Hydra, OmegaConf, antlr4; Liger-Kernel, FlagGems and FlagGems'
#   SQLAlchemy and PyYAML; transformers and its tokenizers, safetensors, hub and regex) as wheels into .whl/
#   (git-ignored), without their dependencies: torch and triton are the GPU machine's own.
# There, through the device tool:        run(command="bash bench/gpu_check.sh", carry=[".whl"])
#   the report is printed and written to $OUT/gpu_check.txt.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
    set -e
    mkdir -p .whl
    exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.2 omegaconf==2.3.0 liger-kernel flag-gems \
        "sqlalchemy>=2" pyyaml transformers tokenizers safetensors huggingface-hub regex
    python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3   # sdist only: build a py3 wheel
    ls .whl
    exit 0
fi

if ! python3 -c "import hydra, omegaconf" 2>/dev/null && [ ! -d .whl ]; then
    echo "no .whl/: run 'bash bench/gpu_check.sh --prepare' first and carry .whl" >&2; exit 2
fi
if [ -d .whl ]; then
    # Only the wheels of packages this machine lacks: its own torch, triton and numpy stay.
    wheels=()
    for w in .whl/*.whl; do
        module=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
        case $module in hydra_core) module=hydra ;; antlr4_python3_runtime) module=antlr4 ;;
                        pyyaml) module=yaml ;; esac
        python3 -c "import $module" 2>/dev/null || wheels+=("$w")
    done
    if [ ${#wheels[@]} -gt 0 ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${wheels[@]}" || exit 2
        export PYTHONPATH=/tmp/site
    fi
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 TRAINJOB_CACHE=/tmp/trainjob-cache
unset TRITON_INTERPRET
report="${OUT:-/tmp}/gpu_check.txt"

section() { printf '\n## %s\n' "$*"; }

e2e() {  # model, label, overrides (kernels=... first)...: one line of tokens/s and MFU from the run's own files
    local model=$1 label=$2; shift 2
    local dir="/tmp/gpu_check/$model-$label"
    rm -rf "$dir"
    timeout "${E2E_TIMEOUT:-120}" python3 -m trainer "model=$model" "hydra.run.dir=$dir" \
        train.progress=false train.eval_every=1000 train.checkpoint_every=1000 "$@" > "$dir.log" 2>&1
    local rc=$?
    if [ -s "$dir/metrics.jsonl" ]; then  # steps logged before a time cap still give the rate
        python3 bench/gpu_report.py --run "$dir" "$model" "$label"
        [ $rc -eq 0 ] || echo "  ($model $label stopped early: exit $rc)"
    else
        echo "$model $label: failed (exit $rc), last lines:"; tail -5 "$dir.log"
    fi
}

if [ "${1:-}" = "overhead" ]; then
    timeout 120 python3 bench/step_overhead.py 2>&1 | tail -8 | tee "$report"
    exit 0
fi
if [ "${1:-}" = "checkpoint" ]; then
    timeout 300 python3 bench/checkpoint.py --models small,1b --saves 3 --steps 2 --seq 1024 2>&1 | tail -8 \
        | tee "$report"
    exit 0
fi
if [ "${1:-}" = "aten" ]; then  # every routed ATen op's forward against eager and FlagGems (a call of its own)
    timeout 280 python3 bench/kernels.py --aten --dtypes bf16,fp32 2>&1 | tee "$report"
    exit 0
fi
if [ "${1:-}" = "models" ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$report"
    timeout 290 python3 bench/models.py --steps 20 --warmup 5 2>&1 | grep -v "model shards" | tee -a "$report"
    exit 0
fi

{
    echo "# bench/gpu_check.sh on $(hostname), $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"
    for package in liger_kernel flag_gems transformers; do
        python3 -c "import importlib.metadata as m; print('$package', m.version('$package'))" 2>/dev/null \
            || echo "$package: not installed (its columns and variants are skipped)"
    done

    # Each section has its own time cap, so the report fits one 10-minute call; a section cut short says so.
    section "pytest tests/ops (CUDA tensors, compiled kernels)"
    # Every specialisation compiles on first use: spread the tests over processes, test by test, where
    # pytest-xdist is there; where it is not, without pyproject's -n option, which needs it.
    parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8 --dist load" || echo "-o addopts=-ra")
    timeout 90 python3 -m pytest tests/ops -q -p no:cacheprovider $parallel 2>&1 | tail -15

    section "python bench/kernels.py --check (Llama-3-8B shapes, 4096 tokens; attention 8192)"
    # Without torch.compile's column (about 10 s of compiling an op, which no target reads).
    timeout 180 python3 bench/kernels.py --check --dtypes bf16,fp32 --compile-dtypes ""

    section "end to end (python -m trainer): tokens/s and MFU (mean over the second half of the logged steps)"
    # triton: what kernels=triton runs by default; triton-cublas: the same with cuBLAS's matmuls.
    printf '%-8s%-8s%12s%8s\n' model kernels "tokens/s" MFU
    mkdir -p /tmp/gpu_check
    one_gpu=(+runtime=torch-distributed runtime.nproc_per_node=1 strategy=fsdp2 data.seq_len=2048
             train.global_batch_size=16 train.max_steps=30 train.log_every=2)
    E2E_TIMEOUT=60 e2e 1b torch kernels=torch "${one_gpu[@]}"
    E2E_TIMEOUT=80 e2e 1b triton kernels=triton "${one_gpu[@]}"
    E2E_TIMEOUT=80 e2e 1b triton-cublas kernels=triton 'kernels.exclude=[mm,addmm,bmm]' "${one_gpu[@]}"

    section "python bench/e2e.py: the peers end to end, one loop for all (batch 4, seq 2048)"
    timeout 40 python3 bench/e2e.py --variants torch,triton,gems,hf,hf-liger --steps 15 model=small
    timeout 40 python3 bench/e2e.py --variants gems,hf,hf-liger --steps 15 --batch 2 model=1b

    section "python bench/gpu_report.py: the issue's targets"
} 2>&1 | tee "$report"
python3 bench/gpu_report.py "$report" 2>&1 | tee -a "$report"
