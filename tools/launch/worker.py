"""One rank of launch_function(): join the group from env, call the target, write its result as JSON."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path


def _load(target: str):
    mod_name, _, attr = target.rpartition(":")
    if mod_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"_moe_ep_rank_target_{Path(mod_name).stem}", mod_name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    return getattr(module, attr)


def main() -> int:
    call = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    import torch

    if os.environ.get("MOE_EP_DEVICE", "cpu") == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from moe_ep.core.dist import init_from_env
    import torch.distributed as dist

    init_from_env()
    try:
        result = _load(call["target"])(**call["kwargs"])
        Path(call["result_dir"], f"rank{rank}.json").write_text(json.dumps({"result": result}))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        # Do not wait for peers in destroy_process_group: they may be the reason we failed.
        os._exit(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
