# session 21, call 6: where two deep's N=32 step goes with the LLM SM carveout (auto: 66 on the H200)
source scripts/gpu_env.sh
set -f
M="model=nemotron_duplex model.weights=random device=cuda"
timeout 200 python3 scripts/profile_step.py $M engine.pipeline=2 'bench.batch_sizes=[32]' 'bench.positions=[1000]' \
  +profile_graphs=true +profile_greedy=true hydra.run.dir=/tmp/h_prof > $OUT/profile_pipeline_2_auto.log 2>&1
echo "exit $?"; grep -E "====|streams|stream |stage spans|GEMM|decode att|fp32 GEMM" $OUT/profile_pipeline_2_auto.log
