# session 21, call 5: call 4's load test again (its summary did not come back): the server two deep under
# load, LLM SM carveout auto; results in one tarball
source scripts/gpu_env.sh
set -f
M="model=nemotron_duplex model.weights=random device=cuda"
OUT=$OUT/load timeout 260 python3 scripts/bench.py $M model.dtype.encoder=bf16 model.dtype.llm=bf16 model.dtype.talker=bf16 \
  engine.pipeline=2 'loadtest.n_calls=[32,128,160]' 'loadtest.starts=[lockstep]' loadtest.duration_s=12 \
  loadtest.time_budget_s=230 hydra.run.dir=/tmp/h_load > /tmp/load.log 2>&1
echo "load exit $?"; cat $OUT/load/summary.md; tail -5 /tmp/load.log
set +f
mv /tmp/load.log $OUT/load/
tar czf /tmp/s21_5.tgz -C $OUT load && rm -rf $OUT/load && mv /tmp/s21_5.tgz $OUT/ && ls -la $OUT
