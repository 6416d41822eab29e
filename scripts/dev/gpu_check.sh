#!/usr/bin/env bash
# Device-machine checks and measurements of the serving defaults, in calls that each fit the device
# tool's 600 s limit (from a cold machine: the GPU tests > 5 min, the step part ~4 min, the load
# part ~6.5 min). Results under $OUT (small files only: Hydra and load directories stay under /tmp, and only
# their summaries are copied). The parts that run the default (compiled) step keep torch.compile's work in
# one compile cache under /tmp ($CACHE), so a later part on the same warm machine restores instead of building.
# Here first: mkdir -p .whl && cp ../shared/device-wheels/*.whl .whl/ (+ pytest's wheels in .whl/extra/,
# wandb's in .whl/wandb/), then run each part with carry [".whl"]:
#   bash scripts/dev/gpu_check.sh tests           # GPU tests of the kernels, the captured step and the talker
#   bash scripts/dev/gpu_check.sh tests-compiled  # the GPU tests of the compiled (default) step (minutes: three builds)
#   bash scripts/dev/gpu_check.sh step [overrides...]   # bench_step N=1/32/128 at position 1000 (buckets 2/32/128)
#   bash scripts/dev/gpu_check.sh table           # the full table: N=1/8/32/64/128 x positions 100/1000/2000,
#                                             # graphs and eager (its command: 99 s), captured by hand (the
#                                             # compiled default's step time without its build)
#   bash scripts/dev/gpu_check.sh profile         # the hand-captured greedy step's kernels at N=32/128, then every compiled
#                                             # Triton kernel's loads by width (scripts/dev/ptx_loads.py)
#   [GATE_DTYPE=fp32] bash scripts/dev/gpu_check.sh gate [seconds] [rows] [overrides...]   # the gate's model rows at full size (random
#                                             # weights, bf16 deployment vs the fp32 yardstick) on clips made
#                                             # here (the device has no espeak-ng): python eval/clips/make_clips.py
#                                             # --out outputs/gate_clips, then carry [".whl", "outputs/gate_clips"];
#                                             # jiwer's wheels (pip download jiwer ... -d .whl/extra) for eval/wer.py,
#                                             # soundfile's and cffi's for W&B's audio (not numpy: the device's stays)
#   bash scripts/dev/gpu_check.sh load [seconds] [server overrides...]
#                                             # the load sweep (both start modes, N up to 160) and the uploads run
#   e.g. bash scripts/dev/gpu_check.sh load 420 engine.open_quiet_ms=0
#   N_CALLS='[32,16]' UPLOAD_RUNS='[]' bash scripts/dev/gpu_check.sh load 100   # a short load run
#   bash scripts/dev/gpu_check.sh admission       # 128 lockstep calls' lag without and with arrivals (~8 min)
#   bash scripts/dev/gpu_check.sh burst           # 128 calls with a cached prompt admitted one by one and together
#   bash scripts/dev/gpu_check.sh capacity [lockstep|staggered] [N] [overrides...]   # N (256) calls of 20-160 s,
#                                             # bf16 SSM state, fp8 talker KV (docs/performance.md, "Memory and capacity")
#   bash scripts/dev/gpu_check.sh compile-cache [backend]   # a reduce-overhead (or `backend`) bucket built cold,
#                                             # then from its compile cache (each run's table row: that back
#                                             # end's step and host time)
#   bash scripts/dev/gpu_check.sh compiled [overrides...]   # the `cudagraph` back end (compiled, captured by hand)
#                                             # with one build for the buckets above 1, cold and from its compile
#                                             # cache (~8 min on an H100)
#   bash scripts/dev/gpu_check.sh fp8-weights     # the float8 projections' GPU tests, their GEMMs against bf16 cuBLAS at
#                                             # N=1/32/128 and the weight-only kernel's sweep at N=32/128 (~9 min);
#                                             # the step with them: `step model.dtype.llm_weights=fp8_weight_only
#                                             # model.dtype.talker_weights=fp8_weight_only`; their fidelity: `gate 500
#                                             # [margins] ++eval.models.bf16_dtype.llm_weights=fp8_weight_only ...`
set -o pipefail
source scripts/dev/gpu_env.sh
export OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
PART=${1:-step}
M="model=nemotron_duplex model.weights=random device=cuda"
# not CC: that is the C compiler Triton builds its launcher with, where the machine exports it
CACHE="engine.compile_cache_dir=/tmp/gpu_check_compile_cache"
HAND="engine.graph_backend=cudagraph-eager"   # the hand capture (the fallback): kernels as written, no build
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [ "$PART" = tests ]; then
    timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/ tests/test_graphs.py tests/test_talker.py -k "not regions and not compiled" \
        > "$OUT/pytest.log" 2>&1; tail -n 3 "$OUT/pytest.log"
elif [ "$PART" = tests-compiled ]; then
    timeout 540 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py -k compiled \
        > "$OUT/pytest_compiled.log" 2>&1; tail -n 3 "$OUT/pytest_compiled.log"
elif [ "$PART" = step ]; then
    mkdir -p "$OUT/step"
    OUT="$OUT/step" timeout 420 python3 scripts/bench_step.py $M $CACHE 'engine.capture_buckets=[2,32,128]' \
        'bench.batch_sizes=[1,32,128]' 'bench.positions=[1000]' bench.iters=10 bench.warmup=2 \
        bench.compare_eager=false hydra.run.dir=/tmp/gpu_check_step "${@:2}" > "$OUT/step.log" 2>&1; tail -n 5 "$OUT/step.log"
elif [ "$PART" = table ]; then
    mkdir -p "$OUT/table"
    OUT="$OUT/table" timeout 500 python3 scripts/bench_step.py $M $HAND 'engine.capture_buckets=[1,8,32,64,128]' \
        'bench.batch_sizes=[1,8,32,64,128]' 'bench.positions=[100,1000,2000]' bench.iters=10 bench.warmup=2 \
        bench.compare_eager=true hydra.run.dir=/tmp/gpu_check_table > "$OUT/table.log" 2>&1; tail -n 17 "$OUT/table.log"
elif [ "$PART" = profile ]; then
    export TRITON_CACHE_DIR=/tmp/gpu_check_triton_cache
    timeout 200 python3 scripts/dev/profile_step.py $M $HAND profile.graphs=true profile.greedy=true 'bench.batch_sizes=[32,128]' \
        'bench.positions=[1000]' hydra.run.dir=/tmp/gpu_check_profile > "$OUT/profile.log" 2>&1
    python3 scripts/dev/ptx_loads.py "$TRITON_CACHE_DIR" > "$OUT/ptx_loads.txt" 2>&1
    grep -A12 "====" "$OUT/profile.log"; head -n 12 "$OUT/ptx_loads.txt"
elif [ "$PART" = gate ]; then
    D=${GATE_DTYPE:-bf16}   # the configured (deployment) dtype; the margins row always compares bf16 with fp32
    timeout "${2:-500}" python3 eval/gate.py $M model/dtype=$D \
        "eval.rows=${3:-[encoder_parity,margins,consistency]}" eval.clips.dir=outputs/gate_clips \
        eval.out_dir="$OUT/gate" wandb.mode=offline hydra.run.dir=/tmp/gpu_check_gate "${@:4}" > "$OUT/gate.log" 2>&1
    echo "gate exit $?"; tr '\r' '\n' < "$OUT/gate.log" | grep -a -E "\[(PASS|FAIL|N/A)\]|^verdict|Error" | tail -n 20
elif [ "$PART" = load ]; then
    LOAD_S=${2:-420}
    shift $(( $# >= 2 ? 2 : $# ))
    ARGS="[]"
    if [ $# -gt 0 ]; then ARGS=$(printf '"%s",' "$@"); ARGS="[${ARGS%,}]"; fi
    timeout $((LOAD_S + 60)) python3 scripts/bench.py $M $CACHE model/dtype=bf16 \
        "loadtest.n_calls=${N_CALLS:-[1,16,32,64,96,128,160]}" loadtest.duration_s=12 \
        "loadtest.upload_runs=${UPLOAD_RUNS:-[32]}" "loadtest.server_args=$ARGS" loadtest.time_budget_s=$LOAD_S \
        loadtest.out=/tmp/gpu_check_load hydra.run.dir=/tmp/gpu_check_hydra > "$OUT/load.log" 2>&1
    cp /tmp/gpu_check_load/{summary.md,load.json,server.log} "$OUT/" 2>/dev/null
    cp /tmp/gpu_check_load/*.png "$OUT/" 2>/dev/null
    tar czf "$OUT/wandb.tgz" -C /tmp/gpu_check_load wandb 2>/dev/null
    tar czf "$OUT/calls.tgz" -C /tmp/gpu_check_load calls 2>/dev/null   # every packet's arrival, per run
    cat "$OUT/summary.md" 2>/dev/null || tail -n 20 "$OUT/load.log"
elif [ "$PART" = admission ]; then
    # live lag at 128 lockstep calls without and with calls arriving (2 a second, fresh 500-token prompts)
    timeout 540 python3 scripts/bench.py $M $CACHE model/dtype=bf16 'loadtest.n_calls=[128]' 'loadtest.starts=[lockstep]' \
        loadtest.duration_s=12 'loadtest.arrival_runs=[128]' loadtest.time_budget_s=200 "${@:2}" \
        loadtest.out=/tmp/gpu_check_admission hydra.run.dir=/tmp/gpu_check_hydra > "$OUT/admission.log" 2>&1
    cp /tmp/gpu_check_admission/{summary.md,load.json,server.log} "$OUT/" 2>/dev/null
    cat "$OUT/summary.md" 2>/dev/null || tail -n 20 "$OUT/admission.log"
elif [ "$PART" = burst ]; then
    timeout 400 python3 scripts/dev/time_admission.py --prompt-tokens 32 --chunk 256 --burst 128 > "$OUT/burst.log" 2>&1
    grep -E "^(graphs|burst)" "$OUT/burst.log" || tail -n 20 "$OUT/burst.log"
elif [ "$PART" = capacity ]; then
    timeout 560 python3 scripts/bench.py $M $CACHE model/dtype=bf16 model.dtype.talker_kv=fp8 model.dtype.mamba_ssm_state=bf16 \
        "loadtest.n_calls=[${3:-256}]" "loadtest.starts=[${2:-lockstep}]" 'loadtest.length_mix=[20,160]' \
        loadtest.max_call_s=162 engine.kv_pool_gib=73 engine.max_prompt_tokens=32 "${@:4}" \
        loadtest.out=/tmp/gpu_check_capacity hydra.run.dir=/tmp/gpu_check_hydra > "$OUT/capacity.log" 2>&1
    cp /tmp/gpu_check_capacity/{summary.md,load.json,server.log} "$OUT/" 2>/dev/null
    cat "$OUT/summary.md" 2>/dev/null || tail -n 20 "$OUT/capacity.log"
elif [ "$PART" = compile-cache ]; then
    # one bucket of a compiled back end (reduce-overhead unless named) built twice, the second time from the
    # first's compile cache: `capture` seconds, and what Inductor's and AOTAutograd's caches did
    rm -rf /tmp/gpu_check_cc
    for run in cold warm; do
        timeout 280 python3 scripts/bench_step.py $M engine.graph_backend=${2:-reduce-overhead} 'engine.capture_buckets=[32]' \
            'bench.batch_sizes=[32]' 'bench.positions=[1000]' bench.compare_eager=false engine.greedy_graphs=false \
            engine.compile_cache_dir=/tmp/gpu_check_cc hydra.run.dir=/tmp/gpu_check_cc_$run > "$OUT/cc_$run.log" 2>&1
        echo "$run:"; grep -E "compile cache|AOTAutograd|^capture|^copy bandwidth|^ +32 " "$OUT/cc_$run.log"
    done
elif [ "$PART" = compiled ]; then
    # the `cudagraph` back end (Inductor's step, captured by hand) as a server of 128 places builds it: the default
    # buckets up to 128, both variants, one build for every bucket above 1 (engine.compile_dynamic_batch); cold
    # into a compile cache, then restored from it (the restart), each with its step at N = 1 / 32 / 128
    rm -rf /tmp/gpu_check_cc_cudagraph
    for run in cold warm; do
        timeout $([ $run = cold ] && echo 390 || echo 180) python3 scripts/bench_step.py $M engine.graph_backend=cudagraph \
            engine.compile_dynamic_batch=true 'bench.batch_sizes=[1,32,128]' 'bench.positions=[600]' \
            bench.compare_eager=false engine.compile_cache_dir=/tmp/gpu_check_cc_cudagraph \
            hydra.run.dir=/tmp/gpu_check_compiled_$run "${@:2}" > "$OUT/compiled_$run.log" 2>&1
        echo "$run (exit $?):"; grep -E "compile cache|AOTAutograd|^capture|^ +N |^ +(1|32|128) +600" "$OUT/compiled_$run.log" \
            || tail -n 20 "$OUT/compiled_$run.log"
    done
elif [ "$PART" = fp8-weights ]; then
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_fp8_weight_linear.py \
        tests/ops/test_fp8_linear.py > "$OUT/fp8_pytest.log" 2>&1; tail -n 3 "$OUT/fp8_pytest.log"
    timeout 150 python3 scripts/dev/bench_ops.py --only fp8_weights --out "$OUT/fp8_gemms" > "$OUT/fp8_gemms.log" 2>&1
    grep "per step" "$OUT/fp8_gemms/bench_ops.md" || tail -n 20 "$OUT/fp8_gemms.log"
    timeout 270 python3 scripts/dev/bench_ops.py --only fp8_weights --quick --sweep --out "$OUT/fp8_sweep" \
        > "$OUT/fp8_sweep.log" 2>&1; tail -n 2 "$OUT/fp8_sweep.log"   # rows as they come: bench_ops_rows.jsonl
else
    echo "usage: bash scripts/dev/gpu_check.sh tests | tests-compiled | step | table | profile | gate [seconds] [rows] [overrides...] |" \
        "load [seconds] [server overrides...] | admission [overrides...] | burst | capacity [start] [N] [overrides...] |" \
        "compile-cache [backend] | compiled [overrides...] | fp8-weights" >&2; exit 2
fi
