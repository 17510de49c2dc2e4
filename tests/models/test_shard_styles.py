"""``autopar.shard`` on the layers Hugging Face models use, in one process: transformers' ``Conv1D`` and
``nn.Embedding`` compute exactly what the modules compute (outside a parallel runtime the operator is the module's
own forward; an embedding's vocabulary slice gives zeros for the ids outside and the slices add up to the lookup),
the styles and a plan by names give the MindSpore tuples they stand for, and what cannot be sharded is one line."""
import pytest
import torch

import autopar
from autopar.errors import StrategyError
from autopar.ops.shard import EmbeddingOp, _style_strategy, has_strategies


def test_conv1d_and_embedding_compute_as_the_modules():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    conv = transformers.pytorch_utils.Conv1D(6, 4).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    want = conv(x)
    autopar.shard(conv, ((1, 1, 1), (1, 1)))
    assert type(conv).__name__ == "ShardedConv1D" and conv._autopar_op.strategy == ((1, 1, 1), (1, 1), (1,))
    assert torch.equal(conv(x), want)
    emb = torch.nn.Embedding(10, 4, padding_idx=3).double()
    ids = torch.tensor([[0, 3, 9, 5], [7, 7, 1, 2]])
    want = emb(ids)
    autopar.shard(emb, "vocab")
    assert torch.equal(emb(ids), want)  # one process: the whole table
    op = EmbeddingOp(padding_idx=3)
    halves = [op.compute(ids, emb.weight[k * 5:(k + 1) * 5], start=k * 5) for k in range(2)]
    assert torch.equal(halves[0] + halves[1], want)
    assert torch.equal(halves[1][0, 0], torch.zeros(4, dtype=torch.float64))  # id 0 is not in rows 5..9


def test_styles_and_plans_by_names_give_the_tuples():
    transformers = pytest.importorskip("transformers")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    n = 1  # one process: the styles split over every rank
    linear, conv = torch.nn.Linear(4, 6), transformers.pytorch_utils.Conv1D(6, 4)
    emb = torch.nn.Embedding(10, 4)
    assert _style_strategy(linear, "colwise", 3) == ((1, 1, 1), (n, 1), (n,))
    assert _style_strategy(linear, "rowwise", 2) == ((1, n), (1, n), (1,))
    assert _style_strategy(conv, "colwise", 3) == ((1, 1, 1), (1, n), (n,))
    assert _style_strategy(conv, "rowwise", 3) == ((1, 1, n), (n, 1), (1,))
    assert _style_strategy(emb, "vocab", 2) == ((1, 1), (n, 1))
    assert _style_strategy(emb, "colwise", 2) == ((1, 1), (1, n))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj, self.norm = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.layers = torch.nn.ModuleList([Block(), Block()])

    net = autopar.shard(Net(), {"*.q_proj": ColwiseParallel(), "*.o_proj": RowwiseParallel(), "embed": "vocab"})
    assert all(b.q_proj._autopar_style == "colwise" and b.o_proj._autopar_style == "rowwise" for b in net.layers)
    assert net.embed._autopar_style == "vocab" and not hasattr(net.layers[0].norm, "_autopar_op")
    assert has_strategies(net)


def _torch_style(name, **kwargs):
    import torch.distributed.tensor.parallel as tp
    from torch.distributed.tensor import Replicate

    kwargs = {k: (Replicate(),) if v is None else v for k, v in kwargs.items()}
    return getattr(tp, name)(**kwargs)


def test_sequence_parallel_plans_mark_the_norms_and_prepare_the_blocks():
    """torchtitan's plan for sequence parallelism: the norms split on the sequence (``SequenceParallel()``, the
    string ``"sequence"``, MindSpore's one-entry tuple), the row-parallel output declared ``Shard(1)``, the blocks'
    inputs prepared -- in one process each module computes as before (the runtime splits only under layouts)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = torch.nn.LayerNorm(4), torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
            self.drop = torch.nn.Dropout(0.0)

        def forward(self, x):
            return x + self.drop(self.down(self.up(self.norm(x))))

    torch.manual_seed(0)
    block, x = Block().double(), torch.randn(2, 6, 4, dtype=torch.float64)
    want = block(x)
    autopar.shard(block, {"norm": SequenceParallel(), "drop": "sequence", "up": ColwiseParallel(),
                          "down": RowwiseParallel(output_layouts=Shard(1))})
    autopar.shard(block, PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
    assert block.norm._autopar_split == ("sequence", 1) and block.drop._autopar_split == ("sequence", 1)
    assert block.down._autopar_output_layout == Shard(1) and block.up._autopar_output_layout is None
    assert block._autopar_prepare is not None and torch.equal(block(x), want)
    norm = autopar.shard(torch.nn.LayerNorm(4), ((2, 2, 1),))  # MindSpore's spelling: (dp, mp, 1)
    assert norm._autopar_split == ("strategy", (2, 2, 1)) and has_strategies(norm)
    assert not has_strategies(norm, splits=False)


@pytest.mark.parametrize("call, message", [
    (lambda: autopar.shard(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"*.q_proj": "colwise"}),
     "pattern '*.q_proj' matches no module of the Sequential"),
    (lambda: autopar.shard(torch.nn.Linear(2, 2), "diagonal"), "style 'diagonal' is not one of colwise, expert, rowwise, sequence, vocab"),
    (lambda: autopar.shard(torch.nn.Linear(2, 2), "vocab"), "'vocab' splits an nn.Embedding's vocabulary"),
    (lambda: autopar.shard(torch.nn.Embedding(4, 2, max_norm=1.0), "vocab"), "max_norm or sparse=True"),
    (lambda: autopar.shard(torch.nn.LayerNorm(2), "colwise"), "cannot shard a LayerNorm"),
    (lambda: autopar.shard(torch.nn.Linear(2, 2), "sequence"),
     "a sequence split is for norms and dropout between tensor-parallel layers, not a Linear (give it colwise"),
    (lambda: autopar.shard(torch.nn.Sequential(torch.nn.LayerNorm(2)), "sequence"),
     "Sequential has children: split its norms and dropouts by name"),
    (lambda: autopar.shard(torch.nn.LayerNorm(2), ((1, 2, 1),), ((1, 2, 1),)), "a sequence split takes no out_strategy"),
    (lambda: autopar.shard(torch.nn.LSTM(2, 2), "sequence"), "a LSTM combines positions along the sequence"),
    (lambda: autopar.shard(torch.nn.Softmax(dim=1), ((1, 2, 1),)), "a Softmax combines positions along the sequence"),
    (lambda: autopar.shard(torch.nn.Linear(2, 2), _torch_style("PrepareModuleOutput", output_layouts=None,
                                                               desired_output_layouts=None)),
     "PrepareModuleOutput is not available"),
])
def test_what_cannot_be_sharded_is_one_line(call, message):
    with pytest.raises(StrategyError) as info:
        call()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_conv1d_given_linear_order_tuples_is_taken_in_their_meaning():
    """GPT-2's Conv1D stores its weight (in, out); the Megatron tuples written for nn.Linear's (out, in) -- the same
    split a Llama's projections take -- mean the same split on it, said once; a tuple that fits neither order is one
    line naming Conv1D's column and row tuples."""
    transformers = pytest.importorskip("transformers")
    for given, taken, what in ((((1, 1, 1), (2, 1)), ((1, 1, 1), (1, 2), (2,)), "columns"),
                               (((1, 1, 2), (1, 2)), ((1, 1, 2), (2, 1), (1,)), "rows")):
        conv = transformers.pytorch_utils.Conv1D(6, 4)
        with pytest.warns(UserWarning, match=rf"reads as nn.Linear's \(out, in\) order and is taken as .* \({what}\)"):
            autopar.shard(conv, given)
        assert conv._autopar_op.strategy == taken
    conv = transformers.pytorch_utils.Conv1D(6, 4)
    autopar.shard(conv, ((1, 1, 1), (1, 2)))  # Conv1D's own order: as it is, no warning
    assert conv._autopar_op.strategy == ((1, 1, 1), (1, 2), (2,))
    with pytest.raises(StrategyError, match=r"Conv1D stores its weight \(in, out\), so columns are \(\(1, 1, 1\), "
                                            r"\(1, 2\)\) and rows \(\(1, 1, 2\), \(2, 1\)\)"):
        autopar.shard(transformers.pytorch_utils.Conv1D(6, 4), ((1, 1, 2), (1, 1)))
