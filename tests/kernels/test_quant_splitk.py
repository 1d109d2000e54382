"""The split-K decode kernels (kernels/quant_splitk.py) against their torch references on fresh
random inputs: int4 in the tile layout, int8 / e4m3 per channel, fp8 W8A8 with the activation
quantization in the kernel; tensor-core and FMA variants, with and without split-K; the layout
round trip and its dequantize kernel; tinygemm's scale-and-zero conversion (its op on CUDA)."""

import pytest
import torch

from tokenforge.kernels import int4_tinygemm
from tokenforge.kernels.quant_gemv import dequantize_channel_ref, dequantize_int4_ref, pack_int4, unpack_int4
from tokenforge.kernels.quant_ops import dequantize_int4_tiles
from tokenforge.kernels.quant_splitk import (QUANT_CHANNEL, QUANT_FP8_A8, QUANT_INT4, SplitKConfig, check_config,
                                             new_counters, quantize_act_blocks_ref, repack_groups, repack_int4,
                                             splitk_gemm, splitk_ref, unrepack_int4)

G = 128


def _int4(n: int, k: int, device):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    scale = (torch.rand(n, k // G, device=device) * 0.02 + 1e-3).bfloat16()
    zero = torch.randint(0, 16, (n, k // G), device=device).bfloat16()
    packed = pack_int4(q)
    return q, packed, scale, zero, dequantize_int4_ref(packed, scale, zero, torch.bfloat16)


def _channel(kind: str, n: int, k: int, device):
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device)
    else:
        q = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, device=device) * k ** -0.5 / 60
    return q, scale, dequantize_channel_ref(q, scale, torch.bfloat16)


def _tol(device) -> float:   # the interpreter truncates fp32 -> bf16 where the GPU rounds
    return 2e-2 if device.type == "cpu" else 1e-2


@pytest.mark.parametrize("block_k", [128, 256, 512])
def test_int4_tile_layout_round_trip(block_k):
    q = torch.randint(0, 16, (6, 1024), dtype=torch.uint8)
    words = repack_int4(pack_int4(q), block_k)
    assert words.dtype == torch.int32 and words.shape == (6, 128)
    assert torch.equal(unrepack_int4(words, block_k), q)
    # nibble i of word j in tile t is input t * block_k + i * block_k / 8 + j
    c = block_k // 8
    assert (words[2, c + 3] >> 4 * 5) & 0xF == q[2, block_k + 5 * c + 3]


# (M, N, K, config): one to sixteen rows, N off the tile multiples, split-K that does and does not
# divide the tiles, FMA and tensor-core variants
INT4_CASES = [(1, 48, 512, SplitKConfig(16, 128, 1, False)), (3, 40, 512, SplitKConfig(16, 256, 2, False)),
              (1, 64, 1024, SplitKConfig(32, 512, 2, True)), (5, 48, 768, SplitKConfig(16, 256, 2, True)),
              (16, 32, 1024, SplitKConfig(16, 128, 3, True)), (8, 200, 1024, SplitKConfig(64, 256, 4, True)),
              (2, 256, 1024, SplitKConfig(128, 512, 2, True, 4, 3)),
              (4, 64, 1024, SplitKConfig(64, 512, 2, True, 4, 1, False))]   # on CUDA: PTX planes but the last


@pytest.mark.parametrize("m,n,k,cfg", INT4_CASES)
def test_int4_splitk_matches_reference(device, rel_err, m, n, k, cfg):
    _, packed, scale, zero, w_ref = _int4(n, k, device)
    x = torch.randn(m, k, device=device).bfloat16()
    bias = torch.randn(n, device=device).bfloat16() if m == 3 else None
    counters = new_counters(n, 16, device)
    for _ in range(2):       # the counters reset themselves: a second call is as right as the first
        y = splitk_gemm(QUANT_INT4, x, repack_int4(packed, cfg.block_k), repack_groups(scale), repack_groups(zero),
                        bias, G, cfg, counters)
        assert rel_err(y, splitk_ref(QUANT_INT4, x, w_ref, bias)) <= _tol(device)
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("m,cfg", [(1, SplitKConfig(16, 128, 1, False)), (4, SplitKConfig(16, 256, 2, False)),
                                   (1, SplitKConfig(32, 128, 4, True)), (9, SplitKConfig(16, 256, 1, True))])
def test_channel_splitk_matches_reference(device, rel_err, kind, m, cfg):
    q, scale, w_ref = _channel(kind, 40, 512, device)
    x = torch.randn(m, 512, device=device).bfloat16()
    y = splitk_gemm(QUANT_CHANNEL, x, q, scale, config=cfg)
    assert rel_err(y, splitk_ref(QUANT_CHANNEL, x, w_ref)) <= _tol(device)


def test_fp8_a8_exact_on_representable_activations(device, rel_err):
    """Activations already on the e4m3 grid with each block's amax at 448 quantize exactly, so the
    fused quantization (scale, cast, tensor-core product, rescale) must give the weight-only result."""
    q, scale, w_ref = _channel("fp8", 48, 512, device)
    codes = torch.randint(-60, 61, (3, 512), device=device).float().to(torch.float8_e4m3fn).float()
    codes[:, ::128] = 448.0
    x = (codes * 0.25).bfloat16()            # scale 0.25 / block: powers of two stay exact
    cfg = SplitKConfig(16, 128, 2, True)
    y = splitk_gemm(QUANT_FP8_A8, x, q, scale, config=cfg)
    assert torch.equal(quantize_act_blocks_ref(x, 128), x.float())
    assert rel_err(y, splitk_ref(QUANT_CHANNEL, x, w_ref)) <= _tol(device)


def test_fp8_a8_random_activations(device, rel_err):
    q, scale, w_ref = _channel("fp8", 40, 512, device)
    x = torch.randn(5, 512, device=device).bfloat16()
    y = splitk_gemm(QUANT_FP8_A8, x, q, scale, config=SplitKConfig(16, 256, 2, True))
    # the interpreter's e4m3 cast truncates: looser there
    assert rel_err(y, splitk_ref(QUANT_FP8_A8, x, w_ref, block_k=256)) <= (1e-1 if device.type == "cpu" else 1e-2)


def test_dequantize_tile_layout(device, rel_err):
    _, packed, scale, zero, w_ref = _int4(70, 1024, device)
    w = dequantize_int4_tiles(repack_int4(packed, 512), repack_groups(scale), repack_groups(zero), torch.bfloat16,
                              G, 512)
    assert rel_err(w, w_ref) <= (1e-2 if device.type == "cpu" else 0)


def test_check_config_refuses_what_the_kernel_cannot_run():
    assert check_config(QUANT_INT4, SplitKConfig(32, 2048, 1), 1, 64, 4096, 128) is not None   # > 8 groups
    assert check_config(QUANT_INT4, SplitKConfig(32, 512, 1, False), 8, 64, 4096, 128) is not None  # FMA, 8 rows
    assert check_config(QUANT_CHANNEL, SplitKConfig(32, 512, 1), 17, 64, 4096, 128) is not None
    assert check_config(QUANT_CHANNEL, SplitKConfig(32, 384, 1), 1, 64, 4096, 128) is not None  # K % tile
    assert check_config(QUANT_INT4, SplitKConfig(32, 512, 4), 16, 64, 4096, 128) is None


def test_tinygemm_scale_and_zeros_reproduce_ours(rel_err):
    q, _, scale, zero, w_ref = _int4(16, 512, torch.device("cpu"))
    sz = int4_tinygemm.scale_and_zeros(scale, zero)
    assert sz.shape == (512 // G, 16, 2)
    ours = dequantize_int4_ref(pack_int4(q), scale, zero, torch.float32)
    # zf = (8 - z) * s is stored in bf16: its rounding is tinygemm's format's own error
    assert rel_err(int4_tinygemm.dequantize_ref(q, sz, G), ours) <= 5e-3
    assert torch.equal(unpack_int4(int4_tinygemm.swap_nibbles(pack_int4(q))), q.view(16, -1, 2).flip(-1).reshape(16, -1))
    assert int4_tinygemm.unsupported(4100, 4096, 128) is not None and int4_tinygemm.unsupported(4096, 4096, 128) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_tinygemm_backend_matches_reference(rel_err, m):
    _, packed, scale, zero, w_ref = _int4(256, 1024, torch.device("cuda"))
    weight, sz = int4_tinygemm.pack(packed, scale, zero)
    x = torch.randn(m, 1024, device="cuda").bfloat16()
    assert rel_err(int4_tinygemm.matmul(x, weight, sz, G), splitk_ref(QUANT_INT4, x, w_ref)) <= 1e-2


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_rms_norm_quant_fp8_matches_the_unfused_chain(device, rel_err, residual, static):
    from tokenforge.kernels.quant_ops import rms_norm_quant_fp8, rms_norm_quant_fp8_ref  # noqa: PLC0415

    torch.manual_seed(0)
    x = torch.randn(5, 640, device=device).bfloat16() * 2
    res = torch.randn(5, 640, device=device).bfloat16() if residual else None
    w = (1 + 0.2 * torch.randn(640, device=device)).bfloat16()
    s = torch.tensor([0.01], device=device) if static else None
    q_ref, s_ref, r_ref = rms_norm_quant_fp8_ref(x, res.clone() if residual else None, w, 1e-5, s)
    q, scale, r = rms_norm_quant_fp8(x, res, w, 1e-5, s)
    cpu = device.type == "cpu"        # the interpreter truncates to bf16 where the GPU rounds
    assert rel_err(scale, s_ref) <= (2e-2 if cpu else 1e-3) and q.dtype == torch.float8_e4m3fn
    # the interpreter's e4m3 cast truncates (up to 1/8 of a value): much looser there
    assert rel_err(q.float() * scale, q_ref.float() * s_ref) <= (1.2e-1 if cpu else 1e-2)
    assert (rel_err(r, r_ref) <= 1e-2 if cpu else torch.equal(r, r_ref)) and (r is res if residual else r is x)


def test_silu_mul_quant_fp8_matches_the_unfused_chain(device, rel_err):
    from tokenforge.kernels.quant_ops import silu_mul_quant_fp8, silu_mul_quant_fp8_ref  # noqa: PLC0415

    torch.manual_seed(0)
    gu = torch.randn(3, 2 * 384, device=device).bfloat16() * 3
    gu[1] = 0                                         # an all-zero row must not divide by zero
    q, scale = silu_mul_quant_fp8(gu)
    q_ref, s_ref = silu_mul_quant_fp8_ref(gu)
    assert scale.shape == (3, 1) and rel_err(scale, s_ref) <= 2e-2
    assert rel_err(q.float() * scale, q_ref.float() * s_ref) <= (1.2e-1 if device.type == "cpu" else 1e-2)
    assert torch.isfinite(q.float()).all()


def _run_ptx(text: str, regs: dict[str, int]) -> dict[str, int]:
    """A tiny emulator of the PTX the int4 tensor-core path inlines (mov, prmt, shr, and, or,
    fma.rn.bf16x2), to check its byte selectors, masks and halves without a GPU."""
    def bf16(bits: int) -> float:
        return torch.tensor([bits], dtype=torch.int32).view(torch.int16)[0:1].view(torch.bfloat16).item()

    def to_bf16(v: float) -> int:            # round to nearest even, as fma.rn does
        return torch.tensor([v], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF

    val = lambda a: regs[a] if a in regs else int(a, 16)   # noqa: E731
    for op in (s.strip() for s in text.replace("{", "").replace("}", "").split(";") if s.strip()):
        if op.startswith(".reg"):
            continue
        name, args = op.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        a = [val(x) for x in src]
        if name == "mov.b32":
            out = a[0]
        elif name == "prmt.b32":
            data = a[0] | (a[1] << 32)
            out = sum(((data >> 8 * ((a[2] >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))
        elif name == "shr.b32":
            out = a[0] >> a[1]
        elif name == "and.b32":
            out = a[0] & a[1]
        elif name == "or.b32":
            out = a[0] | a[1]
        else:
            assert name == "fma.rn.bf16x2", name
            out = sum(to_bf16(bf16((a[0] >> h) & 0xFFFF) * bf16((a[1] >> h) & 0xFFFF) + bf16((a[2] >> h) & 0xFFFF))
                      << h for h in (0, 16))
        regs[d] = out & 0xFFFFFFFF
    return regs


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_dequant_ptx_gives_each_plane_dequantized(groups):
    from tokenforge.kernels.quant_splitk import _dequant_ptx  # noqa: PLC0415

    gen = torch.Generator().manual_seed(groups)
    q = torch.randint(0, 16, (2, 8), generator=gen)                  # [word, nibble]
    z = torch.randint(0, 16, (groups,), generator=gen).float()
    s = (torch.rand(groups, generator=gen) * 0.05 + 1e-3).bfloat16().float()
    pair = lambda v: (lambda b: b | (b << 16))(torch.tensor([v]).bfloat16().view(torch.int16).item() & 0xFFFF)  # noqa: E731
    regs = {"$8": sum(int(q[0, i]) << 4 * i for i in range(8)), "$9": sum(int(q[1, i]) << 4 * i for i in range(8))}
    for g in range(groups):
        regs[f"${10 + g}"] = pair(-128.0 - float(z[g]))
        regs[f"${10 + groups + g}"] = pair(float(s[g]))
    regs = _run_ptx(_dequant_ptx(groups), regs)
    for plane in range(8):
        g = plane * groups // 8
        for half, word in ((0, 0), (16, 1)):
            got = torch.tensor([(regs[f"${plane}"] >> half) & 0xFFFF], dtype=torch.int32).view(torch.int16)[0:1]
            want = ((q[word, plane] - z[g]) * s[g]).to(torch.bfloat16).float()
            assert got.view(torch.bfloat16).item() == want.item(), (plane, word)
