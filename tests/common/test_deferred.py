"""Deferred initialisation in one process: a network built under ``autopar.deferred_init`` (or MindSpore's
``no_init_parameters``) holds no memory, and any one of its parameters can be computed alone, later, with exactly
the values an eager build draws from the same seed -- for models initialised their own way (nanoGPT's
``apply(_init_weights)``, Hugging Face's ``_init_weights`` with RoPE buffers, timm's truncated normals, torch's
rejection-sampled ``trunc_normal_`` and ``orthogonal_``) -- holding one parameter's worth at a time; the random
stream after the build is the eager build's too. A plain ``torch.device("meta")`` build gets its modules' own
initialisers, and a module without one is named in one line."""
import math
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.common import deferred
from autopar.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gpt import GPT, GPTConfig  # noqa: E402


class Mixed(torch.nn.Module):
    """Every way a parameter gets its values that the recorder must follow."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16, padding_idx=0)
        self.fc = torch.nn.Linear(16, 32)
        self.ortho = torch.nn.Linear(32, 8, bias=False)
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.norm = torch.nn.BatchNorm2d(4)
        self.p = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))
        self.register_buffer("table", torch.tensor([1.0, 2.0, 3.0]))  # from host data: stays real
        torch.nn.init.trunc_normal_(self.fc.weight, std=0.02, a=-0.03, b=0.03)  # redraws until in bounds
        torch.nn.init.orthogonal_(self.ortho.weight)
        with torch.no_grad():
            self.p.mul_(2).add_(1)
            self.emb.weight[3].fill_(0.5)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _vit():
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5)


def _resnet():
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


MODELS = {"mixed": Mixed, "nanogpt": lambda: GPT(GPTConfig()), "llama": _llama, "vit": _vit, "resnet18": _resnet}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_parameter_alone_equals_the_eager_build_bit_for_bit(name):
    make = MODELS[name]
    torch.manual_seed(11)
    eager = make()
    after_eager = torch.rand(4)
    torch.manual_seed(11)
    lazy = autopar.deferred_init(make)
    after_lazy = torch.rand(4)
    assert torch.equal(after_eager, after_lazy)  # the build advanced the random stream exactly as eagerly
    lazy_state = lazy.state_dict(keep_vars=True)
    assert lazy_state.keys() == eager.state_dict().keys()
    params = dict(lazy.named_parameters())
    assert params and all(p.is_meta for p in params.values())
    largest = max(p.numel() * p.element_size() for p in eager.parameters())
    for key in reversed(list(lazy_state)):  # any order: each one alone
        held = lazy_state[key]
        value = deferred.full_value(held) if held.is_meta else held
        assert torch.equal(value, eager.state_dict()[key]), key
    recordings = deferred.recordings_of(lazy)
    assert len(recordings) == 1
    # one parameter's replay holds that parameter and what it was computed from, never the model
    assert 0 < recordings[0].largest_held <= 2 * largest
    state = torch.get_rng_state()
    deferred.full_value(next(iter(params.values())))
    assert torch.equal(torch.get_rng_state(), state)  # a replay leaves the user's random stream where it was


def test_materialised_in_place_keeps_the_parameters_an_optimizer_holds():
    torch.manual_seed(3)
    eager = GPT(GPTConfig())
    torch.manual_seed(3)
    lazy = autopar.deferred_init(GPT, GPTConfig())
    opt = torch.optim.AdamW(lazy.parameters(), lr=1e-3)
    held = list(lazy.parameters())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = lazy(ids, ids)[1]  # the first call of any module: no parallel mode, so every rank's whole network
    assert not any(p.is_meta for p in lazy.parameters()) and list(lazy.parameters()) == held
    assert lazy.transformer.wte.weight is lazy.lm_head.weight  # still tied
    assert torch.equal(loss, eager(ids, ids)[1])
    loss.backward()
    opt.step()
    assert not torch.equal(lazy.lm_head.weight, eager.lm_head.weight)


def test_a_plain_meta_build_takes_its_modules_initialisers_from_the_seed_set_after_it():
    with torch.device("meta"):
        lazy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.BatchNorm1d(8),
                                   torch.nn.Linear(8, 2))
    torch.manual_seed(5)
    deferred.record_initialisers(lazy)
    deferred.materialize_module(lazy)
    torch.manual_seed(5)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    for (name, a), b in zip(eager.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_plain_meta_module_without_an_initialiser_is_named_in_one_line():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(4))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.scale = Scale()

    with torch.device("meta"):
        net = Net()
    with pytest.raises(ConfigError) as info:
        deferred.record_initialisers(net)
    message = str(info.value)
    assert "\n" not in message
    assert "'scale' (Scale)" in message and "'gain'" in message and "reset_parameters()" in message
    assert "autopar.deferred_init" in message
    with pytest.raises(ConfigError, match="no recorded initial value"):
        deferred.full_value(net.scale.gain)


def test_no_init_parameters_records_mindspore_initialisers():
    from autopar import Parameter, nn
    from autopar.common.initializer import TruncatedNormal, initializer
    from autopar.nn.utils import no_init_parameters

    def build():
        net = nn.SequentialCell(nn.Dense(4, 8, weight_init="normal"), nn.ReLU(),
                                nn.Dense(8, 3, weight_init=TruncatedNormal(0.5, a=-0.6, b=0.6), bias_init="ones"))
        net.insert_param_to_cell("w", Parameter(initializer("xavier_uniform", [3, 5]), name="w"))
        return net

    autopar.set_seed(4)
    eager = build()
    autopar.set_seed(4)
    with no_init_parameters():
        lazy = build()
    assert all(p.is_meta for p in lazy.parameters())
    for (name, a), b in zip(eager.named_parameters(), lazy.parameters()):
        assert torch.equal(a, deferred.full_value(b)), name
    assert lazy.w.name == "w" and math.isclose(float(deferred.full_value(lazy[2].bias).sum()), 3.0)


def test_a_value_loaded_before_the_network_is_laid_out_is_what_it_materialises():
    torch.manual_seed(2)
    source = GPT(GPTConfig())
    params = {k: v.detach().clone() for k, v in source.state_dict().items()}
    lazy = autopar.deferred_init(GPT, GPTConfig())
    missing = autopar.load_param_into_net(lazy, params)
    assert missing == [] and all(p.is_meta for p in lazy.parameters())  # nothing made whole yet
    deferred.materialize_module(lazy)
    for name, value in lazy.state_dict().items():
        assert torch.equal(value, params[name]), name
    # a plain meta build: a module's own initialiser runs for what was not loaded, the loaded value stays
    with torch.device("meta"):
        plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    weight = torch.full((4, 4), 0.25)
    autopar.load_param_into_net(plain, {"0.weight": weight})
    deferred.record_initialisers(plain)
    deferred.materialize_module(plain)
    assert torch.equal(plain[0].weight, weight) and not plain[1].weight.is_meta


def test_what_a_build_can_do_to_its_tensors_is_replayed_as_done():
    """In-place writes that read their own target (``out=`` aliases, a fill from an element), writes through a list
    (``_foreach``), a generator given positionally, draws whose count depends on values (``multinomial``), a network
    passed into a second build, and storages whose addresses the allocator reuses."""
    gen_seed = 5

    def build(enc=None):
        w = torch.nn.Parameter(torch.empty(6, 6))
        torch.nn.init.normal_(w, 0.0, 1.0, torch.Generator().manual_seed(gen_seed))  # positional generator
        torch.mul(w.data, 2, out=w.data)
        v = torch.nn.Parameter(torch.empty(6))
        with torch.no_grad():
            v.fill_(w[0, 0])
            torch._foreach_mul_([w, v], 3.0)
        picks = torch.multinomial(torch.ones(10), 3).float()  # made on the meta device: drawn from recorded values
        kept = []
        for n in (1 << 18, 1 << 17, 1 << 18, 1 << 17):  # temporaries freed and their addresses reused
            p = torch.empty(n)
            tmp = torch.randn(n) * 2
            p.copy_(tmp)
            kept.append(p)
            del tmp
        head = torch.empty(4)
        if enc is not None:
            head.copy_(enc.weight[0] * 0.5)  # reads the first build's network
        return [w, v, picks, *kept, head]

    torch.manual_seed(0)
    enc_eager = torch.nn.Linear(4, 4)
    eager = build(enc_eager)
    torch.manual_seed(0)
    enc = autopar.deferred_init(torch.nn.Linear, 4, 4)
    lazy = autopar.deferred_init(build, enc)
    assert torch.equal(deferred.full_value(enc.weight), enc_eager.weight)
    for i, (a, b) in enumerate(zip(eager, lazy)):
        assert torch.equal(a, deferred.full_value(b)), i


def test_changes_after_the_build_are_refused_in_one_line():
    lazy = autopar.deferred_init(torch.nn.Linear, 8, 8)
    lazy.to(torch.bfloat16)  # not recorded: the initialisers would draw again from another state
    with pytest.raises(ConfigError, match=r"'weight' is on the meta device without a record.*inside the build"):
        deferred.record_initialisers(lazy)
    cast = autopar.deferred_init(lambda: torch.nn.Linear(8, 8).to(torch.bfloat16))  # inside: recorded
    assert deferred.full_value(cast.weight).dtype == torch.bfloat16
    big = torch.arange(300000, dtype=torch.float32)
    loaded = autopar.deferred_init(torch.nn.Linear, 300000, 1, bias=False)
    autopar.load_param_into_net(loaded, {"weight": big.view(1, -1)})
    big.mul_(2)  # the loaded tensor changed in place before the network was made: refused, not taken silently
    with pytest.raises(ConfigError, match="changed in place since"):
        deferred.full_value(loaded.weight)


def test_tied_parameters_stay_tied_when_materialised_whole():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    lazy = autopar.deferred_init(Tied)
    autopar.load_param_into_net(lazy, {"emb.weight": torch.ones(10, 4), "head.weight": torch.ones(10, 4)})
    assert deferred.materialize_pending() >= 1
    assert lazy.head.weight is lazy.emb.weight and torch.equal(lazy.emb.weight, torch.ones(10, 4))


def test_what_a_checkpoint_will_fill_is_never_computed_and_what_it_missed_is_named():
    """``resume_from=``: the tensors a checkpoint holds are left for it (unset, never replayed); one it then did not
    fill is named in one line."""
    torch.manual_seed(0)
    net = autopar.deferred_init(lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    computed = []
    value = deferred.full_value
    try:
        deferred.full_value = lambda t: computed.append(tuple(t.shape)) or value(t)
        marked = deferred.expect_loaded(net, {"0.weight", "1.weight"})
        deferred.make_whole(net)
    finally:
        deferred.full_value = value
    assert sorted(marked) == ["0.weight", "1.weight"] and sorted(computed) == [(2,), (8,)]  # the biases only
    with torch.no_grad():
        net[0].weight.copy_(torch.ones(8, 4))  # the checkpoint filled one of them
    with pytest.raises(ConfigError, match=r"ckpt-1 did not fill 1\.weight: the network was built on the meta device"):
        deferred.check_loaded(net, marked, "ckpt-1")
