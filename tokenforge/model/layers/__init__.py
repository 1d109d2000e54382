"""Model building blocks: tensor-parallel linears with weight loaders, norms, rotary, attention."""

from tokenforge.model.layers.activation import SiluAndMul
from tokenforge.model.layers.attention import Attention
from tokenforge.model.layers.embedding import LMHead, VocabEmbedding
from tokenforge.model.layers.kernel_dispatch import use_triton_kernels
from tokenforge.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenforge.model.layers.norm import RMSNorm
from tokenforge.model.layers.parallel import default_weight_loader
from tokenforge.model.layers.rotary import RotaryEmbedding

__all__ = [
    "Attention", "ColumnParallelLinear", "LMHead", "MergedColumnParallelLinear", "QKVParallelLinear",
    "RMSNorm", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul", "VocabEmbedding",
    "default_weight_loader", "use_triton_kernels",
]
