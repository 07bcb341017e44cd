"""DSA dense warm-up (SFT): the training forward attends to every causal position, the indexer still distils."""

from __future__ import annotations

import torch

from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.loader import load_model
from kestrel.train.sft import indexer_loss, set_dense_warmup


def _forward(model, ids: torch.Tensor) -> torch.Tensor:
    batch = ForwardBatch(input_ids=ids, positions=torch.arange(len(ids)), extend_lens=[len(ids)], prefix_lens=[0])
    return model.logits(model(batch))


def _dsa_layers(model):
    return [layer.self_attn for layer in model.model.layers if layer.kind == "dsa"]


def test_dense_warmup_attends_to_every_position_and_keeps_the_indexer_loss(tiny_checkpoints):
    model, cfg = load_model(tiny_checkpoints["kimi_k3"])
    topk = _dsa_layers(model)[0].indexer.topk
    ids = torch.randint(3, cfg.vocab_size, (3 * topk,), generator=torch.Generator().manual_seed(0))
    model.train()
    with torch.no_grad():
        sparse = _forward(model, ids)
        set_dense_warmup(model, True)
        warm = _forward(model, ids)
        assert indexer_loss(model) is not None  # the indexer keeps learning during the warm-up
        set_dense_warmup(model, False)
        for attn in _dsa_layers(model):
            attn.indexer.topk = 10 * len(ids)  # a top-k past the sequence: dense attention
        dense = _forward(model, ids)
        for attn in _dsa_layers(model):
            attn.indexer.topk = topk
        model.eval()
        served_sparse = _forward(model, ids)
        set_dense_warmup(model, True)
        served = _forward(model, ids)  # outside training the flag is ignored: serving stays sparse
    torch.testing.assert_close(warm, dense)
    assert (warm - sparse).abs().max() > 1e-3  # the warm-up is not the sparse forward
    torch.testing.assert_close(served, served_sparse)
