"""``mindspore.nn.transformer`` (MindSpore 1.8-2.0's parallel Transformer library). Its mixture of experts is here
(``MoEConfig``, ``MoE``, ``MoEParallelConfig`` with ``expert_parallel``: :mod:`autopar.nn.moe`); the other names
import (so a script loads) and stop at their first use with one line saying what to use instead."""
from autopar.errors import unsupported
from autopar.nn.moe import MoE, MoEConfig, MoEParallelConfig, default_moeparallel_config  # noqa: F401

_INSTEAD = ("build the model from autopar.nn layers (Dense, LayerNorm, Dropout) or torch.nn.TransformerEncoderLayer, "
            "and give its operators strategies (ops.MatMul().shard, autopar.shard) or let AUTO_PARALLEL plan it; "
            "autopar.models.transformer is a ready GPT-style model")
Transformer = unsupported("nn.transformer.Transformer", _INSTEAD)
TransformerEncoder = unsupported("nn.transformer.TransformerEncoder", _INSTEAD)
TransformerDecoder = unsupported("nn.transformer.TransformerDecoder", _INSTEAD)
TransformerEncoderLayer = unsupported("nn.transformer.TransformerEncoderLayer", _INSTEAD)
TransformerDecoderLayer = unsupported("nn.transformer.TransformerDecoderLayer", _INSTEAD)
MultiHeadAttention = unsupported("nn.transformer.MultiHeadAttention", _INSTEAD)
FeedForward = unsupported("nn.transformer.FeedForward", _INSTEAD)
VocabEmbedding = unsupported("nn.transformer.VocabEmbedding", "use autopar.nn.Embedding")
AttentionMask = unsupported("nn.transformer.AttentionMask", "build the mask with torch (torch.tril)")
CrossEntropyLoss = unsupported("nn.transformer.CrossEntropyLoss", "use autopar.nn.CrossEntropyLoss")
TransformerOpParallelConfig = unsupported(
    "nn.transformer.TransformerOpParallelConfig", "set data/model parallel degrees with shard strategies under "
    "set_auto_parallel_context(parallel_mode='semi_auto_parallel'), pipeline stages with pipeline_stages")
