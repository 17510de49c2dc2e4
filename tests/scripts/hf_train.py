"""Worker: models as their users take them from Hugging Face ``transformers`` and ``timm`` (tiny configs built from
config objects, no downloads), trained as their users call them -- keyword inputs, ``labels=`` with the loss inside
``forward``, ``ModelOutput`` results, masks and position ids made inside the network -- in float64, AdamW with 2
micro-steps of accumulation (``loss / 2``) and ``clip_grad_norm_(1.0)``, with only autopar's context call (plus
``autopar.shard`` where the mode needs it), against one process on the same global batches.

argv: OUT_PREFIX CASES_JSON ([[model, mode], ...]). Models: llama (LlamaForCausalLM: GQA, RoPE, SDPA), gpt2
(GPT2LMHeadModel: Conv1D, tied head), bert (BertForSequenceClassification with a padding mask), vit (timm
VisionTransformer: cls token, position-embedding parameter). Modes: data, zero1, zero3, semi (SEMI_AUTO without
strategies), megatron (SEMI_AUTO with ``autopar.shard`` MindSpore tuples on the projections: columns then rows),
names (a torchtitan-style plan by module names with styles, the embedding's vocabulary split too), auto (the first
call plans), auto_explicit (``autopar.parallelize(model, sample={...})``), auto_tight (AUTO under a memory limit
data parallel exceeds: it plans ZeRO-3), auto_megatron (AUTO around the megatron strategies), lone (SEMI_AUTO with single operators split where
DTensor alone went wrong: Llama's ``lm_head`` on its input features -- partial-sum logits that the loss casts to
float32 -- and its first ``q_proj`` alone by columns -- heads split in the query only, which attention moves onto the
batch; BERT's first ``query`` alone by columns -- its padding mask must follow onto the batch), pipe (``autopar.PipelineParallel`` in 2
stages split before the second block, the loss as ``loss_fn`` on the logits; against one process whose micro-steps'
gradients add up, as a pipeline step per micro-step gives), wrapped_pipe (the same, the causal LM inside a
user's six-line wrapper returning ``.logits``), cp (context parallelism: ``dataset_strategy=((1, n), (1, n))``, each
rank loading its slice of every sequence); for mixtral (MixtralForCausalLM, 4 experts, top-2) also ep (expert
parallelism: ``{"*.experts": "expert"}``), ep_zero1 / ep_zero3 (and ZeRO), ep_names (and attention split by
names), ep_seq (and its norms split on the sequence: sequence parallelism, the MoE block flattening the slices), pipe and wrapped_pipe (its experts one opaque operator of the stages' trace). Per case: the largest parameter difference and ``state_dict()`` loaded into a fresh one-process
model, and which parameters are stored split. Writes JSON to OUT_PREFIX.<rank>.
"""
import json
import sys
import traceback

import torch
import torch.nn.functional as F

import autopar
from autopar.communication import get_group_size, get_rank, init

out_prefix, cases = sys.argv[1], json.loads(sys.argv[2])
torch.set_default_dtype(torch.float64)
init()
rank, n = get_rank(), get_group_size()
STEPS, MICRO, GLOBAL, SEQ, VOCAB = 2, 2, 4, 8, 64
TIGHT = 600e3  # bytes per device for auto_tight: less than data parallel needs, what ZeRO-3 needs
g = torch.Generator().manual_seed(0)
IDS = torch.randint(0, VOCAB, (STEPS, MICRO, GLOBAL, SEQ), generator=g)
PAD = torch.ones(STEPS, MICRO, GLOBAL, SEQ, dtype=torch.long)
PAD[..., 1::2, SEQ // 2:] = 0  # every other sample padded: BERT's padding mask, made inside the network
CLS = torch.randint(0, 3, (STEPS, MICRO, GLOBAL), generator=g)
IMG = torch.randn(STEPS, MICRO, GLOBAL, 3, 16, 16, generator=g)


def build(model: str) -> torch.nn.Module:
    torch.manual_seed(1)
    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64, attn_implementation="sdpa"))
    if model == "mixtral":  # a mixture of experts: 4 experts, each token routed to 2
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                num_local_experts=4, num_experts_per_tok=2,
                                                max_position_embeddings=64, attn_implementation="sdpa",
                                                experts_implementation="eager"))  # grouped_mm has no float64
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if model == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=4, intermediate_size=64, num_labels=3,
                                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                        max_position_embeddings=32))
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, num_classes=5)


SEQUENCE_PARTS: list[int] = []  # context parallelism: [parts, part] -- each rank loads its slice of the sequence


def inputs_of(model_name: str, step: int, micro: int, parts: int = 1, part: int = 0) -> tuple[tuple, dict]:
    """The call as the library's users write it: positional and keyword inputs."""
    rows = slice(part * GLOBAL // parts, (part + 1) * GLOBAL // parts)
    ids = IDS[step, micro, rows]
    if SEQUENCE_PARTS:
        cp, c = SEQUENCE_PARTS
        ids = IDS[step, micro, :, c * SEQ // cp:(c + 1) * SEQ // cp].clone()
    if model_name in ("llama", "gpt2", "mixtral"):
        return (), {"input_ids": ids, "labels": ids}
    if model_name == "bert":
        return (), {"input_ids": ids, "attention_mask": PAD[step, micro, rows], "labels": CLS[step, micro, rows]}
    return (IMG[step, micro, rows],), {}


def loss_of(model_name: str, model, step: int, micro: int, parts: int = 1, part: int = 0) -> torch.Tensor:
    args, kwargs = inputs_of(model_name, step, micro, parts, part)
    if model_name == "vit":
        return F.cross_entropy(model(*args), CLS[step, micro][part * GLOBAL // parts:(part + 1) * GLOBAL // parts])
    return model(*args, **kwargs).loss


def train(model_name: str, model, parts: int = 1, part: int = 0, micro_step=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        for micro in range(MICRO):
            if micro_step is not None:  # a pipeline's step: forward and backward of the micro-step
                micro_step(step, micro)
                continue
            (loss_of(model_name, model, step, micro, parts, part) / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def full(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.named_parameters()}


def reference(model_name: str, summed: bool = False) -> dict:
    """One process on the global batches; ``summed``: the micro-steps' gradients added undivided (what a
    pipeline's ``step()`` per micro-step gives: each is the mean over its own pipeline micro-batches)."""
    autopar.reset_auto_parallel_context()
    SEQUENCE_PARTS.clear()  # the whole sequence
    with autopar.context.managed():  # one process: its calls must not parallelize it
        model = build(model_name)
        step_fn = (lambda step, micro: outside_loss(model_name, model, step, micro).backward()) if summed else None
        return full(train(model_name, model, micro_step=step_fn))


SPLITS = {"llama": "model.layers.1", "gpt2": "transformer.h.1", "bert": "bert.encoder.layer.1", "vit": "blocks.1",
          "mixtral": "model.layers.1"}


def lm_loss(logits, labels):
    """The loss ``labels=`` computes inside a causal LM (next-token: shifted by one), on the pipeline's output."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def outside_loss(model_name: str, model, step: int, micro: int) -> torch.Tensor:
    """The pipeline's loss in one process: ``lm_loss`` on the logits (HF's own loss upcasts logits to float32,
    which float64 training would see as ~1e-6 apart), the classifiers' cross-entropy as ``labels=`` computes it."""
    if model_name not in ("llama", "gpt2", "mixtral"):
        return loss_of(model_name, model, step, micro)
    ids = IDS[step, micro]
    return lm_loss(model(input_ids=ids).logits, ids)


class LogitsOf(torch.nn.Module):
    """The six lines a user writes to pipeline a causal LM: a wrapper that returns its ``.logits``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def pipelined(model_name: str, model, wrapped: bool = False):
    """``autopar.PipelineParallel`` split before the second block; the loss as ``loss_fn`` on the logits (the
    last stage's output: a ModelOutput's tensors), the inputs positional, the label last. ``wrapped``: the model
    inside :class:`LogitsOf` (its layers hand an expanded mask and RoPE's cos/sin across the split)."""
    autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    loss_fn = lm_loss if model_name in ("llama", "gpt2", "mixtral") else F.cross_entropy
    net, split = (LogitsOf(model), f"model.{SPLITS[model_name]}") if wrapped else (model, SPLITS[model_name])
    runner = autopar.PipelineParallel(net, loss_fn, micro_batches=2, split_points=[split])
    parts, part = runner.replicas, runner.replica

    def micro_step(step, micro):
        args, kwargs = inputs_of(model_name, step, micro, parts, part)
        if model_name in ("llama", "gpt2", "mixtral"):
            runner.step(kwargs["input_ids"], kwargs["labels"])
        elif model_name == "bert":
            runner.step(kwargs["input_ids"], kwargs["attention_mask"], kwargs["labels"])
        else:
            runner.step(args[0], CLS[step, micro][part * GLOBAL // parts:(part + 1) * GLOBAL // parts])

    return micro_step


def set_mode(mode: str) -> None:
    autopar.reset_auto_parallel_context()
    name = {"auto": "auto_parallel", "auto_explicit": "auto_parallel", "semi": "semi_auto_parallel",
            "megatron": "semi_auto_parallel", "names": "semi_auto_parallel", "lone": "semi_auto_parallel"}.get(mode, "data_parallel")
    autopar.set_auto_parallel_context(parallel_mode=name, gradients_mean=True)
    if mode == "auto_megatron":
        autopar.set_auto_parallel_context(parallel_mode="auto_parallel")
    if mode == "auto_tight":  # less memory than data parallel needs: the planner shards the optimizer
        autopar.set_auto_parallel_context(parallel_mode="auto_parallel", max_device_memory=TIGHT)
    if mode.startswith("zero") or mode.startswith("ep_zero"):
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                          parallel_optimizer_config={"optimizer_level": f"level{mode[-1]}"})
    SEQUENCE_PARTS[:] = [n, rank] if mode.startswith("cp") else []
    if mode.startswith("ep"):  # expert parallelism (ep_zero1: and ZeRO-1; ep_names: and the attention by names)
        autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    if mode.startswith("cp"):  # context parallelism: input_ids and labels split on the sequence (cp_ring: a ring)
        autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy=((1, n), (1, n)),
                                          context_parallel_algo="ring" if mode == "cp_ring" else "all_gather")


# Megatron's plan per model: the first projection of attention and MLP split by columns (output features), the
# second by rows (input features: partial sums). MindSpore tuples for (input, weight), weight (out, in) as nn.Linear's
COLUMNS = {"llama": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), "gpt2": ("c_attn", "c_fc"),
           "bert": ("query", "key", "value", "intermediate.dense"), "vit": ("fc1",)}  # timm's fused qkv: below
ROWS = {"llama": ("o_proj", "down_proj"), "gpt2": ("attn.c_proj", "mlp.c_proj"),
        "bert": ("attention.output.dense", "layer.0.output.dense", "layer.1.output.dense"), "vit": ("attn.proj", "fc2")}


def megatron(model_name: str, model) -> None:
    conv1d = model_name == "gpt2"  # transformers' Conv1D: weight (in, out), as MindSpore's MatMul
    for name, module in model.named_modules():
        if name.endswith(COLUMNS[model_name]):
            autopar.shard(module, ((1, 1, 1), (1, n) if conv1d else (n, 1)))
        elif name.endswith(ROWS[model_name]):
            autopar.shard(module, ((1, 1, n), (n, 1) if conv1d else (1, n)))


LONE = {"llama": {"lm_head": ((1, 1, n), (1, n)), "model.layers.0.self_attn.q_proj": ((1, 1, 1), (n, 1))},
        "gpt2": {"transformer.h.0.attn.c_proj": ((1, 1, n), (n, 1))},  # Conv1D: weight (in, out)
        "bert": {"bert.encoder.layer.0.attention.self.query": ((1, 1, 1), (n, 1))}}


def by_names(model_name: str, model) -> None:
    """The plan as torchtitan users write it: module-name patterns -> styles (strings or torch's objects), the
    embedding's vocabulary split too (GPT-2's tied to its head, which splits the same rows as its columns)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plans = {
        "llama": {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise", "*.o_proj": "rowwise",
                  "*.gate_proj": "colwise", "*.up_proj": "colwise", "*.down_proj": "rowwise",
                  "model.embed_tokens": "vocab"},
        "gpt2": {"*.c_attn": ColwiseParallel(), "*.c_fc": ColwiseParallel(), "*.c_proj": RowwiseParallel(),
                 "transformer.wte": RowwiseParallel(), "lm_head": ColwiseParallel()},
        "bert": {"*.query": "colwise", "*.key": "colwise", "*.value": "colwise", "*.attention.output.dense":
                 "rowwise", "*.intermediate.dense": "colwise", "*.layer.?.output.dense": "rowwise",
                 "*.word_embeddings": "vocab"},
        "vit": {"*.fc1": "colwise", "*.fc2": "rowwise", "*.attn.proj": "rowwise"},
    }
    autopar.shard(model, plans[model_name])


def run(model_name: str, mode: str, ref: dict) -> dict:
    from torch.distributed.tensor import DTensor

    set_mode(mode)
    model = build(model_name)
    if mode in ("megatron", "auto_megatron"):  # auto_megatron: AUTO plans the rest around the user's strategies
        megatron(model_name, model)
    if mode == "names":
        by_names(model_name, model)
    if mode.startswith("ep"):
        autopar.shard(model, {"*.experts": "expert"})
    if mode in ("ep_names", "ep_seq"):
        autopar.shard(model, {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
                              "*.o_proj": "rowwise"})
    if mode == "ep_seq":  # and Megatron's sequence parallelism: the norms on each rank's slice of the sequence, the
        # MoE block's router and experts on the flattened slices
        autopar.shard(model, {"*.input_layernorm": "sequence", "*.post_attention_layernorm": "sequence",
                              "model.norm": "sequence"})
    if mode == "lone":
        for name, strategy in LONE[model_name].items():
            autopar.shard(model.get_submodule(name), strategy)
    if mode == "auto_explicit":  # the PyTorch door's explicit call, planned on keyword inputs
        args, kwargs = inputs_of(model_name, 0, 0, n, rank)
        autopar.parallelize(model, sample=kwargs or list(args))
    if mode in ("pipe", "wrapped_pipe"):
        train(model_name, model, micro_step=pipelined(model_name, model, wrapped=mode == "wrapped_pipe"))
        ref = reference(model_name, summed=True)
    else:
        train(model_name, model, *((1, 0) if mode.startswith("cp") else (n, rank)))
    got = full(model)
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    sd = model.state_dict()
    autopar.reset_auto_parallel_context()
    with autopar.context.managed():
        one = build(model_name)
        one.load_state_dict(sd)
    reload = max((p.detach() - ref[k]).abs().max().item() for k, p in one.named_parameters())
    pretrained = None
    if mode in ("megatron", "names", "zero3") and model_name != "vit":  # save_pretrained -> from_pretrained
        folder = f"{out_prefix}.{model_name}.{mode}.pretrained"
        model.save_pretrained(folder)  # (transformers writes from the main process: rank 0)
        torch.distributed.barrier()
        autopar.reset_auto_parallel_context()
        with autopar.context.managed():
            again = type(model).from_pretrained(folder)
        pretrained = max((p.detach() - ref[k]).abs().max().item() for k, p in again.named_parameters())
    split = sorted(k for k, v in model.named_parameters()
                   if isinstance(v, DTensor) and any(p.is_shard() for p in v.placements))
    return {"param": worst, "state_dict_reload": reload, "split": split, "save_pretrained": pretrained}


results, refs = {}, {}
for model_name, mode in cases:
    key = f"{model_name}/{mode}"
    try:
        if model_name not in refs:
            refs[model_name] = reference(model_name)
        results[key] = run(model_name, mode, refs[model_name])
    except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
        results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:600]}", "trace": traceback.format_exc()[-2500:]}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
