# GPU run 4 (short): the merged FP8 / W4A8 staging base after the duplicate removal, and the FP8 suite's oracle cases.
source .dev/p2/site.sh >/dev/null && source .dev/p2/env.sh || exit 9
export PYTHONPATH=$PWD:$PYTHONPATH
LAUNCH="python3 -m tools.launch.launcher --nproc 1 --device cuda --"
step staging 60 $LAUNCH tests/shim/sm90/fp8_staging_gpu_test.py -q -p no:cacheprovider
step w4a8_checks 150 python3 -m tools.bench.w4a8 --skip-timing --budget-s 100 --out $L/w4a8_checks
pack 4
grep "^| \(w4a8_mxfp4\|fp8_tensor\) " $L/w4a8_checks.log | head -20; grep -i "staging" $L/w4a8_checks.log | head -3
