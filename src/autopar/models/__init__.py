"""Reference networks: the MindSpore tutorials' ResNet-50 (plain ``torch.nn.Module`` with MindSpore parameter
names), a wide MLP, a transformer block and a Llama-style decoder layer for the planner's benchmarks."""
from autopar.models.mlp import mlp
from autopar.models.resnet import ResidualBlock, ResidualBlockWithDown, ResNet, ResNetStage, resnet50
from autopar.models.transformer import LlamaBlock, TransformerBlock

__all__ = ["LlamaBlock", "ResNet", "ResNetStage", "ResidualBlock", "ResidualBlockWithDown", "TransformerBlock", "mlp", "resnet50"]
