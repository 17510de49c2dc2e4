"""Hugging Face ``transformers`` models as their users train them, in every mode of the PyTorch door: tiny
``LlamaForCausalLM`` (GQA, RoPE, SDPA), ``GPT2LMHeadModel`` (Conv1D, tied head) and ``BertForSequenceClassification``
(a padding mask) built from config objects (no downloads), called with keyword inputs and ``labels=`` (the loss
inside ``forward``, a ``ModelOutput`` back), float64, AdamW + 2 micro-steps + ``clip_grad_norm_(1.0)`` -- equal to
one process on the same global batches, ``state_dict()`` loading into a fresh one-process model, and (sliced and
ZeRO-3 modes) ``save_pretrained`` read back by ``from_pretrained``; the causal LMs also context parallel, and a
``MixtralForCausalLM`` with its experts spread over the ranks, and pipelined. One launch runs
every case (tests/scripts/hf_train.py)."""
import pytest

from procutil import autopar_cmd

from hf_cases import TOL, train_cases

pytest.importorskip("transformers")

MODELS = ["llama", "gpt2", "bert"]
MODES = ["data", "zero1", "zero3", "semi", "megatron", "names", "auto", "auto_explicit", "auto_tight", "auto_megatron",
         "lone", "pipe"]
# what the plans by names must store split: the projections, and the embedding's vocabulary (GPT-2's tied head too)
SPLIT = {"llama": {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                   "model.layers.1.mlp.down_proj.weight"},
         "gpt2": {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"},
         "bert": {"bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.attention.self.query.weight",
                  "bert.encoder.layer.1.output.dense.weight"}}


def test_transformers_models_train_exactly_in_every_mode(procs, tmp_path):
    # wrapped_pipe: a user's wrapper returning .logits, pipelined (its stages pass a strided mask and RoPE tables);
    # cp: context parallelism -- each rank loads half of every sequence (input_ids and labels), RoPE's positions,
    # the causal mask and the shifted labels of the loss inside forward taken at their global places (cp_ring: the
    # keys and values passed round a ring, the causal work balanced over mirrored chunks)
    # mixtral: a mixture of experts -- its experts spread over the ranks (ep), with ZeRO-3, with attention by names
    # (and its norms split on the sequence: ep_seq),
    # and pipelined (its experts one opaque operator of the stage's trace, which cannot follow their routing)
    cases = [[m, mode] for m in MODELS for mode in MODES] + [[m, x] for x in ("wrapped_pipe", "cp")
                                                             for m in ("llama", "gpt2")] + [["llama", "cp_ring"]] + [
        ["mixtral", mode] for mode in ("data", "ep", "ep_zero3", "ep_names", "ep_seq", "pipe", "wrapped_pipe")]
    for rank, case, r in train_cases(procs, tmp_path, cases):
        model, mode = case.split("/")
        if mode in ("megatron", "names", "zero3"):  # save_pretrained from the parallel model, from_pretrained
            assert r["save_pretrained"] is not None and r["save_pretrained"] <= TOL, (rank, case, r)
        if mode == "names":
            assert SPLIT[model] <= set(r["split"]), (rank, case, r["split"])
        elif mode in ("megatron", "auto_megatron"):
            assert SPLIT[model] - {n for n in SPLIT[model] if "embed" in n or "wte" in n} <= set(r["split"]), \
                (rank, case, r["split"])
        elif mode == "lone":  # the single operators split, and the results exact (checked in train_cases)
            assert r["split"], (rank, case, r["split"])
        elif mode.startswith("ep"):  # each rank keeps half of every layer's experts
            assert {f"model.layers.{k}.mlp.experts.{w}" for k in (0, 1) for w in ("gate_up_proj", "down_proj")} <= \
                set(r["split"]), (rank, case, r["split"])
        elif mode in ("data", "semi", "cp", "cp_ring"):  # whole parameters (ZeRO stores slices; AUTO chooses)
            assert not r["split"], (rank, case, r["split"])
        elif mode == "auto_tight":  # under the limit weights are stored as slices: the planner's ZeRO-3, or a
            # layout of the operators that fits and measured faster in the round (BERT's did)
            assert r["split"], (case, r)


GQA_SPLIT = """import torch
import autopar
from transformers import LlamaConfig, LlamaForCausalLM

autopar.communication.init()
autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
autopar.shard(model, {"*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise", "*.o_proj": "rowwise"})
ids = torch.randint(0, 64, (2, 8))
model(input_ids=ids, labels=ids).loss.backward()
"""


def test_key_value_heads_split_over_more_ranks_than_they_are_is_one_line(procs, tmp_path):
    """A Llama with 2 key/value heads (grouped-query attention) whose k and v projections are split by columns over
    4 ranks (a 2 x 2 world mesh): each rank's slice holds half a head, which DTensor lets through and the rank's own
    view refuses ("shape [...] is invalid for input of size ..."). One line names the heads and what to split
    instead. (On 2 ranks over one key/value head DTensor gathers the heads and runs.)"""
    script = tmp_path / "gqa_split.py"
    script.write_text(GQA_SPLIT)
    res = procs.run(autopar_cmd("launch", "-n", "4", "--log-dir", str(tmp_path / "logs"), str(script)), timeout=240)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    line = [e for e in res.stderr.splitlines() if e.startswith("autopar: error:")]
    assert len(line) == 1 and "the split cuts inside the new dimensions" in line[0] and \
        "divides the key/value heads, or leave k and v whole" in line[0], res.stderr
