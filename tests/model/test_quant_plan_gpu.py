"""Each decode backend through the quant methods on CUDA (skipped without it): forced by
TOKENFORGE_QUANT_KERNEL, every row count 1..16 gives the dequantized weight's product, and the
split-K int4 layer keeps only the tile layout (prefill dequantizes from it)."""

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.conftest import _rel_err
from tokenforge import envs
from tokenforge.model.layers.linear import RowParallelLinear
from tokenforge.model.quant import kernel_plan
from tokenforge.model.quant.fp8 import Fp8Method
from tokenforge.model.quant.int4 import Int4Method
from tokenforge.model.quant.int8 import Int8Method

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _layer(method, k: int = 1024, n: int = 768):
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = RowParallelLinear(k, n, params_dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.03)
    layer.quant_method = method
    method.create_weights(layer)
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("backend,make", [("splitk", lambda: Int4Method(128)), ("tinygemm", lambda: Int4Method(128)),
                                          ("qgemv", lambda: Int4Method(128)), ("splitk", Int8Method),
                                          ("splitk", Fp8Method), ("dense", Int8Method)])
@torch.inference_mode()
def test_forced_backend_matches_the_dequantized_product(monkeypatch, backend, make):
    monkeypatch.setenv(envs.QUANT_KERNEL, backend)
    method = make()
    layer = _layer(method)
    assert layer.q_plan.choice(1) is None if backend == "dense" else layer.q_plan.choice(1).backend == backend
    w = method.dequantize(layer, torch.bfloat16)
    for m in (1, 2, 4, 7, 16, 40):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        y = layer(x)
        ref = F.linear(x.float(), w.float()).to(torch.bfloat16)
        tol = 5e-2 if isinstance(method, Fp8Method) else 1e-2      # W8A8: the activations are quantized too
        assert _rel_err(y, ref) <= tol, (backend, m)


@torch.inference_mode()
def test_splitk_int4_keeps_only_the_tile_layout(monkeypatch):
    monkeypatch.setenv(envs.QUANT_KERNEL, "splitk")
    layer = _layer(Int4Method(128))
    assert layer.q_weight is None and layer.q_words.dtype == torch.int32
    assert layer.q_scale_t.shape == (1024 // 128, 768)
    kernel_plan._table.cache_clear()


@torch.inference_mode()
def test_fp8_many_rows_fuse_the_activation_quantization_into_norm_and_silu(monkeypatch):
    """Above the decode rows, W8A8's per-token quantization runs inside the norm / SwiGLU kernel:
    the same product as the unfused chain (norm kernel, then quantize, then _scaled_mm)."""
    from tokenforge.model.layers import RMSNorm, SiluAndMul  # noqa: PLC0415
    from tokenforge.model.layers.linear import MergedColumnParallelLinear  # noqa: PLC0415

    monkeypatch.delenv(envs.QUANT_KERNEL, raising=False)
    method = Fp8Method()
    down = _layer(method)                                       # 1024 -> 768
    with torch.device("cuda"):
        gate_up = MergedColumnParallelLinear(768, [1024, 1024], params_dtype=torch.bfloat16)
        norm = RMSNorm(768, 1e-6, torch.bfloat16)
    torch.nn.init.normal_(gate_up.weight, std=0.03)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)     # uninitialised until a loader writes it
    gate_up.quant_method = method
    method.create_weights(gate_up)
    method.process_weights_after_loading(gate_up)
    x = torch.randn(40, 768, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(40, 768, device="cuda", dtype=torch.bfloat16)
    y, new_res = gate_up.forward_normed(norm, x, res.clone())
    h, res_ref = norm(x, res.clone())
    assert torch.equal(new_res, res_ref) and _rel_err(y, method.matmul(gate_up, h, None)) <= 1e-3
    gu = torch.randn(40, 2048, device="cuda", dtype=torch.bfloat16)
    assert _rel_err(down.forward_silu_mul(SiluAndMul(), gu), method.matmul(down, SiluAndMul()(gu), None)) <= 1e-3
