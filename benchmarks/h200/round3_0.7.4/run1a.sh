# GPU run 1a: regressions after the house/models/eplb/defaults merges (one H200).
source .dev/p2/site.sh && source .dev/p2/env.sh || exit 9
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
LAUNCH="python3 -m tools.launch.launcher --nproc 1 --device cuda --"
step suite 240 env MOE_EP_GPU_LOG=$L/suite $LAUNCH tests/shim/sm90/multirank_gpu_test.py -q -p no:cacheprovider
step staging 60 $LAUNCH tests/shim/sm90/fp8_staging_gpu_test.py -q -p no:cacheprovider
step eplb_fp8 120 env MOE_EP_TEST_BACKEND=sm90_fp8_cutedsl MOE_EP_TEST_DEVICE=cuda MOE_EP_TEST_WORLD_SIZES=1 python3 -m pytest -q -p no:cacheprovider tests/moe_ep/eplb_multirank_test.py
step eplb_bf16 120 env MOE_EP_TEST_BACKEND=sm90_bf16_cutedsl MOE_EP_TEST_DEVICE=cuda MOE_EP_TEST_WORLD_SIZES=1 python3 -m pytest -q -p no:cacheprovider tests/moe_ep/eplb_multirank_test.py
step chunking 120 env MOE_EP_GPU_LOG=$L/chunking $LAUNCH tests/moe_ep/chunking_gpu_test.py -q -p no:cacheprovider
pack 1a
grep -h "STEP" $L/*.log >/dev/null; ls $L
