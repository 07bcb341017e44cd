"""The reference path's cache: contiguous per-sequence tensors, no paging. Ground truth for the engine."""

from __future__ import annotations

import torch

from kestrel.models.decoder import CausalLM
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.vision.inputs import encode_images, image_offsets, splice_rows


class SimpleCache:
    """Holds, for each of `num_seqs` sequences, MLA latents / rope keys / index keys and KDA states.

    Invariant: after a forward of batch B, sequence i's tensors cover positions [0, prefix_lens[i] + extend_lens[i]).
    """

    def __init__(self, model: CausalLM, num_seqs: int) -> None:
        self.batch: ForwardBatch | None = None
        self.kv: dict[int, list[list[torch.Tensor | None]]] = {
            layer: [[None, None, None] for _ in range(num_seqs)] for layer in model.cfg.attention_layers
        }
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in model.cfg.kda_layers:
            self.states[layer] = model.model.layers[layer].self_attn.empty_state(num_seqs, model.device)

    def bind(self, batch: ForwardBatch) -> ForwardBatch:
        """Attach to a batch whose sequence i is cache sequence i."""
        self.batch = batch
        batch.cache = self
        return batch

    def store_kv(self, layer: int, latent, rope_key, index_key) -> None:
        for seq in range(self.batch.num_seqs):
            sl = self.batch.seq_slice(seq)
            entry = self.kv[layer][seq]
            for j, new in enumerate((latent, rope_key, index_key)):
                if new is not None:
                    entry[j] = new[sl] if entry[j] is None else torch.cat([entry[j], new[sl]])

    def load_kv(self, layer: int, seq: int):
        latent, rope_key, index_key = self.kv[layer][seq]
        return latent, rope_key, index_key

    def _decode_entries(self, layer: int) -> list[list[torch.Tensor | None]]:
        return [self.kv[layer][seq] for seq in range(self.batch.num_decode)]

    def decode_lengths(self) -> torch.Tensor:
        entries = self._decode_entries(next(iter(self.kv)))
        return torch.tensor([e[0].shape[0] for e in entries], device=entries[0][0].device)

    def _padded(self, layer: int, j: int) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence([e[j] for e in self._decode_entries(layer)], batch_first=True)

    def decode_kv(self, layer: int):
        return self._padded(layer, 0), self._padded(layer, 1)

    def decode_pool(self, layer: int) -> None:
        return None  # per-sequence tensors, no pool

    def decode_index_keys(self, layer: int):
        return self._padded(layer, 2)

    def decode_kv_at(self, layer: int, positions):
        entries = self._decode_entries(layer)
        latent = torch.stack([e[0][p] for e, p in zip(entries, positions)])
        return latent, torch.stack([e[1][p] for e, p in zip(entries, positions)])

    def load_state(self, layer: int):
        conv, rec = self.states[layer]
        n = self.batch.num_seqs
        return conv[:n], rec[:n]

    def decode_state_views(self, layer: int) -> None:
        return None  # the oracle path keeps load + store

    def sequence_state_views(self, layer: int) -> None:
        return None

    def store_state(self, layer: int, conv_state, recurrent_state) -> None:
        conv, rec = self.states[layer]
        n = self.batch.num_seqs
        conv[:n] = conv_state
        rec[:n] = recurrent_state


@torch.inference_mode()
def full_logits(model: CausalLM, input_ids: list[int] | torch.Tensor, images: list | None = None) -> torch.Tensor:
    """Logits [T, V] of one whole sequence with no cache: the plainest forward (`images`: the prompt's
    `ProcessedImage`s, spliced over its placeholder runs)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=model.device)
    return model.logits(model(with_images(model, ForwardBatch.single(ids), images)))


def with_images(model: CausalLM, batch: ForwardBatch, images: list | None) -> ForwardBatch:
    """A one-sequence prefill batch with its images' features spliced over their placeholder runs."""
    if images:
        offsets = image_offsets(batch.input_ids.tolist(), images, model.cfg.vision.image_token_id)
        batch.mm_rows = torch.tensor(splice_rows(offsets, images), dtype=torch.long, device=model.device)
        batch.mm_embeds = torch.cat(encode_images(model, images))
    return batch


@torch.inference_mode()
def greedy_generate(
    model: CausalLM, prompt: list[int], max_new_tokens: int, images: list | None = None
) -> tuple[list[int], torch.Tensor]:
    """Reference greedy decoding: prefill once (images spliced), then one token at a time through `SimpleCache`.

    Returns the new tokens and the logits [max_new_tokens, V] that chose them.
    """
    cache = SimpleCache(model, 1)
    ids = torch.tensor(prompt, dtype=torch.long, device=model.device)
    hidden = model(cache.bind(with_images(model, ForwardBatch.single(ids), images)))
    logits = model.logits(hidden[-1:])
    out, all_logits = [], []
    for step in range(max_new_tokens):
        all_logits.append(logits[0])
        token = int(logits[0].argmax())
        out.append(token)
        if step + 1 == max_new_tokens:
            break
        batch = ForwardBatch.single(torch.tensor([token], device=model.device), prefix_len=len(prompt) + step)
        logits = model.logits(model(cache.bind(batch)))
    return out, torch.stack(all_logits)
