# Sourced after site.sh on the H200 host: the carried tree and transformers 5.24, NVLink multicast off.
export PYTHONPATH=/tmp/site2:$PYTHONPATH
export MOE_EP_SM90_TREE=/tmp/x/sm90
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export L=/tmp/logs; mkdir -p $L
step() { # step NAME TIMEOUT_S CMD... : run one step, log it, print a one-line verdict
  local name=$1 t=$2; shift 2; local s=$(date +%s)
  timeout -k 5 $t "$@" > $L/$name.log 2>&1; local rc=$?
  echo "STEP $name rc=$rc $(( $(date +%s) - s ))s :: $(grep -aE '(passed|failed|error)' $L/$name.log | tail -1 | cut -c1-150)"
}
pack() { tar -czf $OUT/logs_$1.tgz -C /tmp logs; }
