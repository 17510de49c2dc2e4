"""``mindspore.train.train_thor.dataset_helper``: MindSpore's device-queue dataset helper (graph-mode sinking)."""
from autopar.errors import ACCUMULATE_INSTEAD, unsupported

DatasetHelper = unsupported("train.train_thor.dataset_helper.DatasetHelper", ACCUMULATE_INSTEAD)
connect_network_with_dataset = unsupported("connect_network_with_dataset", ACCUMULATE_INSTEAD)
