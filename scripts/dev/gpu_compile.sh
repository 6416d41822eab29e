#!/usr/bin/env bash
# The whole-step torch.compile build (engine.graph_backend=reduce-overhead) at full size on the device
# machine. A build of one bucket takes ~70 s (without graphs/fallbacks.py it ran over 6 minutes; that
# file says why). The build runs detached (setsid), so a longer one goes on between calls while
# the machine stays warm (30 s after a call), and writes under outputs/compile/ (ignored, kept between
# calls on a warm machine):
#   bash scripts/dev/gpu_compile.sh start [bench_step overrides...]   # launch, then wait as below
#   bash scripts/dev/gpu_compile.sh wait                               # wait up to WAIT_S (540) for it, log tail
# Every 60 s the build's process writes its main thread's stack to stacks.log (where the build spends its time).
# Inductor's caches go to outputs/compile/cache, so a second start of the same build measures a warm start.
# M replaces the model and device (a CPU smoke run: M='model=nemotron_duplex_tiny device=cpu').
# Results are copied to $OUT: bench.log, stacks.log, bench_step_*.json.
set -o pipefail
source scripts/dev/gpu_env.sh
D=outputs/compile
mkdir -p "$D"
if [ "${1:-wait}" = start ]; then
    rm -f "$D/done" "$D/bench.log" "$D/stacks.log" "$D"/bench_step_*.json
    export TORCHINDUCTOR_CACHE_DIR=$PWD/$D/cache TRITON_CACHE_DIR=$PWD/$D/cache/triton TORCH_LOGS=${TORCH_LOGS:-cudagraphs}
    setsid bash -c "OUT=$D python3 -c \"
import runpy, sys, threading, time, traceback
def sample(main=threading.main_thread().ident, out=open('$D/stacks.log', 'w')):
    while True:   # Python-level sampling holds the GIL (faulthandler's watchdog dump crashed the build)
        time.sleep(60)
        frame = sys._current_frames().get(main)
        out.write(time.strftime('%T') + '\\n' + ''.join(traceback.format_stack(frame)[-30:]) + '\\n')
        out.flush()
threading.Thread(target=sample, daemon=True).start()
sys.argv = ['scripts/bench_step.py'] + sys.argv[1:]
runpy.run_path('scripts/bench_step.py', run_name='__main__')
\" ${M:-model=nemotron_duplex model.weights=random device=cuda} engine.graph_backend=reduce-overhead \
        'engine.capture_buckets=[32]' 'bench.batch_sizes=[32]' 'bench.positions=[1000]' bench.iters=20 \
        bench.warmup=3 bench.compare_eager=false engine.greedy_graphs=false hydra.run.dir=/tmp/gpu_compile ${*:2} \
        > $D/bench.log 2>&1; echo \$? > $D/done" < /dev/null > /dev/null 2>&1 &
    echo "started $(date +%T)"
fi
for _ in $(seq $(( ${WAIT_S:-540} / 10 ))); do [ -f "$D/done" ] && break; sleep 10; done
echo "done: $(cat "$D/done" 2>/dev/null || echo 'not yet') at $(date +%T)"
cp "$D/bench.log" "$D/stacks.log" "$D"/bench_step_*.json "${OUT:-/tmp}/" 2>/dev/null
grep -v "^\s*$" "$D/bench.log" | tail -n 40
