"""Reference networks of the MindSpore tutorials, as plain ``torch.nn.Module`` s with MindSpore parameter names."""
from autopar.models.resnet import ResidualBlock, ResidualBlockWithDown, ResNet, ResNetStage, resnet50

__all__ = ["ResNet", "ResNetStage", "ResidualBlock", "ResidualBlockWithDown", "resnet50"]
