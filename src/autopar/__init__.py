"""autopar: MindSpore-style distributed parallel training for PyTorch.

Two doors, one house: MindSpore names (``autopar.communication.init``, ``autopar.set_auto_parallel_context``,
``autopar.train.Model`` ...) are thin aliases over the PyTorch-native core in the sub-packages.
"""
__version__ = "0.1.0"
