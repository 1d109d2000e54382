"""AWQ checkpoints (`quant_method: awq`, version gemm): qweight int32 [K, N/8] and qzeros
[K/G, N/8] with the nibble order 0, 2, 4, 6, 1, 3, 5, 7, scales [K/G, N]; w = (q - z) * s.
Every tensor is [in, out], so each declares its dims for the loaders. They run as int4 (int4.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenforge.model.quant.base import QuantMethod, add_param, drop_weights
from tokenforge.model.quant.int4 import check_group_size, install_int4
from tokenforge.model.quant.scheme import CheckpointScheme, unpack_int32, unsupported

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble i of a word holds column _AWQ_ORDER[i] of its 8


def parse(qc: dict) -> CheckpointScheme:
    version = str(qc.get("version", "gemm")).lower()
    label = f"awq {version}, {qc.get('bits')} bits, group {qc.get('group_size')}"
    if version != "gemm" or qc.get("bits", 4) != 4 or not qc.get("zero_point", True):
        raise unsupported(label)
    return CheckpointScheme("awq", label, group_size=int(qc.get("group_size", 128)), symmetric=False,
                            ignore=tuple(qc.get("modules_to_not_convert") or ()))


class AwqMethod(QuantMethod):
    name = "awq"

    def __init__(self, scheme: CheckpointScheme) -> None:
        self.scheme = scheme

    def check(self, layer: nn.Module, name: str) -> None:
        check_group_size(layer.in_features, self.scheme.group_size, name)

    def create_weights(self, layer: nn.Module) -> None:
        n, k, g, device = layer.out_features, layer.in_features, self.scheme.group_size, drop_weights(layer)
        layer.weight = None
        add_param(layer, "qweight", (k, n // 8), torch.int32, device, output_dim=1, input_dim=0, output_pack=8)
        add_param(layer, "qzeros", (k // g, n // 8), torch.int32, device, output_dim=1, input_dim=0, output_pack=8,
                  input_pack=g)
        add_param(layer, "scales", (k // g, n), torch.float32, device, output_dim=1, input_dim=0, input_pack=g)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.qweight.data, _AWQ_ORDER).t().contiguous()        # [N, K]
        zero = unpack_int32(layer.qzeros.data, _AWQ_ORDER).t().float()           # [N, K/G]
        install_int4(layer, q, layer.scales.data.t(), zero, self.scheme.group_size)

    def apply(self, layer, x, bias):
        raise AssertionError("an AWQ layer runs on the int4 method it was converted to")


__all__ = ["AwqMethod", "parse"]
