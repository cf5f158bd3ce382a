# GPU run 3: the perf fix, the shared-workspace case, the checkpoint through the loader, W4A8 tuning + timing.
source .dev/p2/site.sh >/dev/null && source .dev/p2/env.sh || exit 9
export PYTHONPATH=$PWD:$PYTHONPATH
LAUNCH="python3 -m tools.launch.launcher --nproc 1 --device cuda --"
step defaults_cost 90 python3 -m tools.diag.defaults_cost --tokens 1 8 --out $L/defaults_cost
step shared_ws 90 env MOE_EP_GPU_LOG=$L/shared_ws $LAUNCH tests/shim/sm90/multirank_gpu_test.py -q -p no:cacheprovider -k share_one_workspace
step ckpt 150 $LAUNCH -m tools.checkpoint.gpu_load --cases real:cpu --out $L/ckpt
cp shim/sm90/tables/h200.json $L/h200_before.json
step tune 200 python3 -m tools.tune --models dsv3 --fmt w4a8_mxfp4 --capacities 8 32 128 512 2048 4096 --table shim/sm90/tables/h200.json --budget-s 150
cp shim/sm90/tables/h200.json $OUT/h200.json
step bench 120 python3 -m tools.bench.w4a8 --skip-checks --budget-s 90 --out $L/bench
pack 3
grep -h "STEP" /dev/null; tail -4 $L/shared_ws.log | cut -c1-200; cat $L/defaults_cost.log | grep "^|" ; grep "^|" $L/ckpt.log | head -12; grep "wrote\|done in" $L/tune.log | cut -c1-260; grep "^|" $L/bench.log | tail -10
