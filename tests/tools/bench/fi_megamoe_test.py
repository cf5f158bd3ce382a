"""tools/bench/fi_megamoe.py and its pack step on CPU: FlashInfer gets the weights ours multiplies (its byte order and
scale window, read back by the rule its weights module documents), and the pack carries what the imports and the
includes name, found by reading them (a synthetic wheel)."""

import io
import sys
import zipfile

import pytest
import torch

from tools.bench import fi_megamoe, fi_megamoe_pack


def _decode_fi(packed, scales, g):
    """FlashInfer's documented reading of its MXFP4 input: byte b of each 4-byte word holds K[b] in its high nibble
    and K[b+4] in its low one; a block's value is e2m1(code) * 2^(scale - 127) * g[expert]."""
    from moe_ep.formats import codecs

    e, n, half = packed.shape
    words = packed.to(torch.int32).reshape(e, n, half // 4, 4)
    codes = torch.cat((words >> 4, words & 15), dim=-1).reshape(e, n, half * 2).to(torch.uint8)
    scale = torch.pow(2.0, scales.to(torch.float32) - 127).repeat_interleave(32, dim=-1)
    return codecs.e2m1_decode(codes) * scale * g.view(e, 1, 1)


def test_flashinfer_gets_the_weights_ours_multiplies():
    from moe_ep.formats import quantize_weights

    gen = torch.Generator().manual_seed(3)
    e, h, i = 3, 256, 128
    # Experts of very different magnitudes: each needs its own power of two to land in FlashInfer's window.
    mags = torch.tensor([1e-4, 1.0, 40.0]).view(e, 1, 1)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * mags).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) * mags).to(torch.bfloat16)
    w13[1, :, :64] = 0  # an all-zero block's scale sits below the window; it multiplies nothing
    qw = quantize_weights("w4a8_mxfp4", w13, w2)
    (p13, s13), (p2, s2), g13, g2 = fi_megamoe.fi_weights(qw, "cpu")
    assert p13.shape == (e, 2 * i, h // 2) and p13.dtype == torch.uint8 and s13.shape == (e, 2 * i, h // 32)
    for s in (s13, s2):
        assert int(s.min()) >= fi_megamoe.FI_SCALE_LO and int(s.max()) <= fi_megamoe.FI_SCALE_LO + 11
    d13, d2 = qw.dequantize()
    assert torch.equal(_decode_fi(p13, s13, g13), d13) and torch.equal(_decode_fi(p2, s2, g2), d2)
    assert len(set(g13.tolist())) == 3  # one power of two per expert


def test_a_pack_whose_scales_span_more_than_the_window_is_refused():
    from moe_ep.formats import quantize_weights

    qw = quantize_weights("w4a8_mxfp4", torch.randn(1, 64, 128), torch.randn(1, 128, 32))
    wide = qw.w13_scale.view(torch.uint8).clone()
    wide[0, 0, 0] = int(wide.max()) - 14
    qw.w13_scale = wide.view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="span more than FlashInfer's window"):
        fi_megamoe.fi_weights(qw, "cpu")


def _wheel(files):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return zipfile.ZipFile(io.BytesIO(buf.getvalue()))


def test_the_pack_follows_imports_and_includes_and_nothing_else():
    files = {
        "flashinfer/__init__.py": "import flashinfer.everything\n",
        "flashinfer/everything.py": "",
        "flashinfer/megamoe/__init__.py": "from ..jit.megamoe import gen\nfrom .weights import x\n",
        "flashinfer/megamoe/weights.py": "def f():\n    from flashinfer.utils import late\n",
        "flashinfer/megamoe/unused.py": "",
        "flashinfer/utils.py": "import torch\n",
        "flashinfer/jit/__init__.py": "from . import env\n",
        "flashinfer/jit/env.py": "from ..version import v\n",
        "flashinfer/jit/megamoe.py": "from .core import spec\n",
        "flashinfer/jit/core.py": "import tvm_ffi\n",
        "flashinfer/jit/other.py": "",
        "flashinfer/version.py": "",
        "flashinfer/data/csrc/megamoe/k.cu": '#include "common.cuh"\n#include <cuda_runtime.h>\n#include "gen.inc"\n',
        "flashinfer/data/csrc/megamoe/common.cuh": '#include "tvm_ffi_utils.h"\n#if 0\n#include <cute/a.hpp>\n#endif\n',
        "flashinfer/data/csrc/tvm_ffi_utils.h": "#include <flashinfer/layout.cuh>\n",
        "flashinfer/data/include/flashinfer/layout.cuh": '#include "detail/../detail/x.cuh"\n',
        "flashinfer/data/include/flashinfer/detail/x.cuh": "",
        "flashinfer/data/cutlass/include/cute/a.hpp": "#include <cute/b.hpp>\n",
        "flashinfer/data/cutlass/include/cute/b.hpp": "",
        "flashinfer/data/cutlass/include/cute/unused.hpp": "",
    }
    z = _wheel(files)
    names, read = set(z.namelist()), z.read
    py = fi_megamoe_pack.python_closure(names, read)
    assert py == sorted(["flashinfer/megamoe/__init__.py", "flashinfer/megamoe/weights.py", "flashinfer/utils.py",
                         "flashinfer/jit/__init__.py", "flashinfer/jit/env.py", "flashinfer/jit/megamoe.py",
                         "flashinfer/jit/core.py", "flashinfer/version.py"])
    cpp = fi_megamoe_pack.include_closure(names, read)
    # Every branch of the preprocessor is followed (cute/a.hpp under #if 0): more than a compile reads, never less.
    assert cpp == sorted(["flashinfer/data/csrc/megamoe/k.cu", "flashinfer/data/csrc/megamoe/common.cuh",
                          "flashinfer/data/csrc/tvm_ffi_utils.h", "flashinfer/data/include/flashinfer/layout.cuh",
                          "flashinfer/data/include/flashinfer/detail/x.cuh",
                          "flashinfer/data/cutlass/include/cute/a.hpp", "flashinfer/data/cutlass/include/cute/b.hpp"])


def test_the_pin_is_the_workspace_one():
    version, sha = fi_megamoe_pack.pinned()
    text = fi_megamoe_pack.WORKSPACE.read_text()
    assert f'SM90_VERSION = "{version}"' in text and f'SM90_SHA256 = "{sha}"' in text and len(sha) == 64


def test_capacity_and_the_jobs_for_our_side():
    assert [fi_megamoe.capacity_for(t) for t in (1, 8, 9, 4096)] == [8, 8, 16, 4096]
    jobs = fi_megamoe.our_jobs(fi_megamoe.TOKENS)
    assert [(j["capacity"], j["tokens"]) for j in jobs] == [(8, [1, 8]), (32, [32]), (128, [128]), (512, [512]),
                                                           (2048, [2048]), (4096, [4096])]
    assert all(j["fmt"] == "w4a8_mxfp4" and j["kind"] == "time" for j in jobs)


def test_a_missing_bundle_is_an_import_failure_with_exit_4(tmp_path, capsys):
    assert fi_megamoe.main(["--bundle", str(tmp_path / "none.tar.xz"), "--unpack-to", str(tmp_path / "u"),
                            "--cpu-check"]) == 4
    assert "the bundle does not import" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
