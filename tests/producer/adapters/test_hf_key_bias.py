"""The Hugging Face adapter's structural exclusion: softmax self-attention key biases found
by module type and path (producer.adapters.hf.attention_key_biases), never by magnitude."""

from __future__ import annotations

import torch
import transformers

from producer.adapters.hf import attention_key_biases


def tiny_bert() -> torch.nn.Module:
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=2, intermediate_size=37,
        vocab_size=99))


def test_bert_key_biases_by_structure() -> None:
    model = tiny_bert()
    names = {id(p): n for n, p in model.named_parameters()}
    found = [names[id(p)] for p in attention_key_biases(model)]
    assert found == [f"bert.encoder.layer.{i}.attention.self.key.bias" for i in range(3)]


def test_no_bias_or_no_self_attention_means_nothing() -> None:
    no_bias = tiny_bert()
    for layer in no_bias.bert.encoder.layer:
        layer.attention.self.key = torch.nn.Linear(32, 32, bias=False)
    assert attention_key_biases(no_bias) == []
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert attention_key_biases(plain) == []


def test_a_wrapper_finds_the_same_parameters() -> None:
    model = tiny_bert()
    wrapped = torch.nn.ModuleDict({"inner": model})
    assert [id(p) for p in attention_key_biases(wrapped)] == \
        [id(p) for p in attention_key_biases(model)]
