"""Beyond one NVLink domain, and past the fused kernel at large T: the split EP paths (docs/scale-out.md).

  topology.py    which ranks reach each other by NVLink P2P (domains); $MOE_EP_DOMAINS simulates or declares them
  layout.py      the index math of dispatch and combine (one row per (token, destination), partials summed in order)
  transport.py   torch.distributed all_to_all_single: exact splits (eager) or a padded grid (CUDA-graph capturable)
  engine.py      what computes a rank's own experts: the reference, the fused kernel at world size 1, ...
  torch_engine.py  grouped GEMMs torch ships, under their own numerics (GPU)
  backend.py     `split`: dispatch, engine, combine
  two_level.py   `two_level`: the fused kernel inside each domain, the transport between domains
  plan.py, auto.py  `auto`: measure the paths the group can run per capacity bucket, keep the fastest (layer.plan)
  hooks.py       the few calls MoELayer makes into this package

Registered by lazy strings (moe_ep/core/registry.py): MoELayer(..., backend="split" | "two_level" | "auto").
Torch only: the kernels are named by registry names, never imported here.
"""
