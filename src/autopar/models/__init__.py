"""Reference networks: the MindSpore tutorials' ResNet-50 (plain ``torch.nn.Module`` with MindSpore parameter
names), a wide MLP and a transformer block for the planner's benchmarks."""
from autopar.models.mlp import mlp
from autopar.models.resnet import ResidualBlock, ResidualBlockWithDown, ResNet, ResNetStage, resnet50
from autopar.models.transformer import TransformerBlock

__all__ = ["ResNet", "ResNetStage", "ResidualBlock", "ResidualBlockWithDown", "TransformerBlock", "mlp", "resnet50"]
