#!/usr/bin/env bash
# Every GPU check and benchmark in one device call (the lent H200 has no internet and a bare image).
# Usage on the device, from the repository root with .whl/ and .bench-data/ (or .bench.tar.xz) carried:
#   [SIZES="0.8B 4B"] bash benchmarks/run_gpu.sh [step ...]
#   scoreboard steps: qps passages agent fidelity startup invariance attention gdn gdn-options conv graphs
#   token-tree steps (0.8B): text packing
#   several GPUs (every visible one; a machine of two or more): multi
#   investigation steps (benchmarks/investigations/): check profile qps-threads host-wake
#   self-checks of new paths (investigations/): gemma-check fp8-check full-card
#   flide 0.1.4 side by side (its wheels in .whl): vs-flide (SIZES may name Gemma 4 sizes: E4B 31B --turns ...;
#   VS_FLIDE_ARGS=--pipeline adds pipeline("decision"), with .whl-tf carried: transformers 5.25)
#   photographs in asks against flide 0.1.4 and pipeline("decision") (.whl-tf, .bench-images carried): images
#   (default: attention gdn fidelity)
# JSON results land in $OUT (one <benchmark>-<size>.json per benchmark and size) with a combined log; on the
# development machine `python benchmarks/readme_results.py --record <the returned files>` makes them the latest
# results (benchmarks/results/latest/, a row each in results/history.csv) and regenerates the tables. The engine benchmarks (qps passages
# agent startup) print their JSON to $OUT only; the log gets their stderr tail and targets. Nothing else goes
# to $OUT: the device tool brings back at most 8 files (a run of qps passages agent once lost a JSON that way).
# Each step's output goes to the log as it is printed (a step cut by a time limit still leaves what it
# printed), and each step ends with its wall time. Steps take, on a warm 0.8B run: fidelity 4-5 min (its
# transformers runs use torch's Gated DeltaNet, one prompt at a time), qps 2, passages and agent 1.5 each,
# gdn-options 3, profile and conv 1, graphs 3 with --no-float32 (its float32 engine took over 6 more at c7deb9b:
# give the full check a call of its own).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/msgspec*.whl .whl/pytest_asyncio*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/fla_core*.whl .whl/flash_linear*.whl || true
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/flide .whl/flide-*.whl .whl/pydantic*.whl \
  .whl/annotated_types*.whl .whl/typing_inspection*.whl .whl/typing_extensions*.whl .whl/fla_core*.whl \
  .whl/flash_linear*.whl || true  # flide 0.1.4, the vs-flide step's other engine
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# the data packed in one file (.bench.tar.xz: benchmarks/README.md), unpacked once per machine
if [ -f .bench.tar.xz ] && [ -z "${FLIDE_BENCH_DATA:-}" ]; then
  [ -d .bench/configs ] || { mkdir -p .bench && tar xJf .bench.tar.xz -C .bench; } || exit 1
  export FLIDE_BENCH_DATA=$PWD/.bench
fi
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-attention gdn fidelity}
# GDN knob settings timed (with their errors, unpadded and padded as the engine replays them) next to the
# default by the gdn-options step, each in a process of its own (bench_gdn --isolate: the variants of e29605c
# died together of an illegal memory access, the first being 3 scan stages): the scan's pipeline depth (its
# tile loads issued stages - 1 steps ahead since the segment-major chunk table), its warps and V tile, and
# the output kernel's V tile. The scan is the lone round's largest GDN kernel.
GDN_OPTIONS=${GDN_OPTIONS:-'[{"scan_stages": 2}, {"scan_warps": 8}, {"block_v": 64}, {"block_v": 64, "scan_warps": 8}, {"split_v": 2}]'}
sizes=${SIZES:-0.8B 4B}  # model sizes of the per-size steps
# An engine benchmark against transformers (with flash-linear-attention) at one model size: JSON and stderr
# in $OUT, the log gets the stderr tail and the targets line.
engine_bench() {
  local script=$1 size=$2
  PYTHONPATH=/tmp/fla:$PYTHONPATH python3 "benchmarks/$script.py" --model-size "$size" > /dev/null 2> "/tmp/$script-$size.err"
  tail -c 1500 "/tmp/$script-$size.err"
  python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1], "targets:", json.dumps(d.get("targets", d.get("summary"))))' "$OUT/$script-$size.json"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/log.txt"
for step in $steps; do
  echo "=== $step" | tee -a "$OUT/log.txt"
  started=$SECONDS
  case $step in
    attention) for size in 0.8B 4B; do python3 benchmarks/bench_attention.py --model-size $size; done ;;
    gdn) for size in $sizes; do PYTHONPATH=/tmp/fla:$PYTHONPATH python3 benchmarks/bench_gdn.py --model-size $size --no-sweep; done ;;
    gdn-options) for size in $sizes; do PYTHONPATH=/tmp/fla:$PYTHONPATH python3 benchmarks/bench_gdn.py --model-size $size \
      --no-sweep --isolate --variants "$GDN_OPTIONS"; done ;;
    graphs) for size in $sizes; do python3 benchmarks/check_graphs.py --model-size $size --no-float32 | tail -c 3000; done ;;
    profile) for size in $sizes; do python3 benchmarks/investigations/profile_round.py --model-size $size | tail -c 3000; done ;;
    fidelity) for size in $sizes; do  # the float32 engine's CUDA exactness check at 0.8B only (eager, slow)
        python3 benchmarks/fidelity.py --model-size $size $([ "$size" = 0.8B ] || echo --no-engine-fp32) \
          $([ -d /tmp/flide/flide ] && echo --flide /tmp/flide); done ;;
    check) python3 benchmarks/investigations/check_kernels.py ;;
    conv) for size in $sizes; do python3 benchmarks/bench_conv.py --model-size $size | tail -c 3000; done ;;
    qps) for size in $sizes; do engine_bench questions_per_state $size; done ;;
    # Q = 1 with the tokenizer on 1 and 4 worker threads (default: one per CPU), no baseline: whether its threads
    # slow the host stages that follow (plan_cpu_seconds, launch_cpu_seconds)
    qps-threads) for threads in 1 4; do python3 benchmarks/questions_per_state.py --model-size 0.8B --q 1 \
      --no-baseline --tokenizer-threads $threads > /dev/null 2> /tmp/qps-threads.err; tail -c 600 /tmp/qps-threads.err
      done ;;
    passages) for size in $sizes; do engine_bench short_passages $size; done ;;
    agent) for size in $sizes; do engine_bench agent_replay $size; done ;;
    startup) for size in $sizes; do engine_bench startup $size; done ;;
    multi) for size in $sizes; do engine_bench multi_gpu $size; done ;;
    invariance) for size in $sizes; do engine_bench invariance $size; done ;;
    host-wake) python3 benchmarks/investigations/host_wake.py | tail -c 600 ;;  # the host's idle and thread wake-up costs
    text) python3 benchmarks/text_scoring.py --model-size 0.8B > /dev/null 2> /tmp/text.err; tail -c 1500 /tmp/text.err ;;
    packing) python3 benchmarks/packing.py --model-size 0.8B | tail -c 3000 ;;
    gemma-check) python3 benchmarks/investigations/gemma_cuda_check.py --out "$OUT/gemma_cuda_check.json" | tail -c 3000 ;;
    fp8-check) python3 benchmarks/investigations/fp8_cuda_check.py --out "$OUT/fp8_cuda_check.json" | tail -c 3000 ;;
    full-card) for free in 3 1.5; do python3 benchmarks/investigations/full_card.py --model-size 0.8B --free-gib $free \
      | tail -c 800; done ;;
    images) for size in $sizes; do  # needs .whl-tf (transformers 5.25, Pillow) and .bench-images carried: README
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tf .whl-tf/*.whl
        FLIDE_BENCH_DATA=${FLIDE_BENCH_DATA:-$PWD/.bench-images} PYTHONPATH=/tmp/tf:/tmp/flide:$PYTHONPATH \
          python3 benchmarks/images.py --model-size $size > /dev/null 2> "/tmp/images-$size.err"
        tail -c 2500 "/tmp/images-$size.err"; done ;;
    vs-flide) for size in $sizes; do  # both engines resident unless the shape needs turns (31B, 26B-A4B)
        turns=$(case $size in 31B|26B-A4B) echo --turns ;; esac)
        [ -d .whl-tf ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tf .whl-tf/*.whl
        PYTHONPATH=/tmp/tf:/tmp/flide:$PYTHONPATH python3 benchmarks/vs_flide.py --model-size $size $turns \
          ${VS_FLIDE_ARGS:-} > /dev/null \
          2> "/tmp/vs_flide-$size.err"; tail -c 1500 "/tmp/vs_flide-$size.err"; done ;;
    *) echo "unknown step $step" ;;
  esac >> "$OUT/log.txt" 2>&1
  echo "--- $step: $((SECONDS - started)) s" | tee -a "$OUT/log.txt"
done
tail -c 6000 "$OUT/log.txt"
