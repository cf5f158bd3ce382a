# GPU run 1b: host cost, defaults, clean end, models (one H200).
source .dev/p2/site.sh && source .dev/p2/env.sh || exit 9
LAUNCH="python3 -m tools.launch.launcher --nproc 1 --device cuda --"
step host_cost 120 python3 -m tools.diag.host_cost --tokens 1 8 128 --out $L/host_cost
step defaults_cost 120 python3 -m tools.diag.defaults_cost --tokens 1 8 128 --out $L/defaults_cost
step clean_end 150 python3 -m tools.diag.clean_end --nproc 1 --out $L/clean_end
step tf_gpu 200 env MOE_EP_GPU_LOG=$L/tf $LAUNCH tests/moe_ep/integrations/transformers_gpu_test.py -q -p no:cacheprovider
step main_model 120 python3 -m tools.main --model --device cuda --ranks 1
step gpu_default 60 env -u MOE_EP_DEVICE python3 -c "import moe_ep; c=moe_ep.init_from_env(); print(c.device, c.pg_backend)"
pack 1b
cat $L/host_cost/*.md $L/defaults_cost/*.md 2>/dev/null | head -60; tail -5 $L/clean_end.log; tail -8 $L/main_model.log
