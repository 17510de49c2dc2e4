"""Reference networks: the MindSpore tutorials' ResNet-50 (plain ``torch.nn.Module`` with MindSpore parameter
names), a wide MLP, a transformer block, a Llama-style decoder layer and a mixture-of-experts block for the planner's benchmarks."""
from autopar.models.mlp import mlp
from autopar.models.moe import MoEBlock, StackedExperts
from autopar.models.resnet import ResidualBlock, ResidualBlockWithDown, ResNet, ResNetStage, resnet50
from autopar.models.transformer import LlamaBlock, TransformerBlock

__all__ = ["LlamaBlock", "MoEBlock", "ResNet", "ResNetStage", "ResidualBlock", "ResidualBlockWithDown", "StackedExperts",
           "TransformerBlock", "mlp", "resnet50"]
