"""Image features by content hash: the vision tower runs once per image while its features stay cached.

A request's placeholder span may be split over several prefill chunks (and steps), be recomputed after a
preemption, or repeat across requests and turns; every one of those reads the same cached rows. Entries are
evicted least recently used past `max_tokens` feature rows, never those the current step needs.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kestrel.models.vision.inputs import encode_images
from kestrel.models.vision.preprocess import ProcessedImage


class EncoderCache:
    def __init__(self, model, max_tokens: int) -> None:
        self.model, self.max_tokens = model, max_tokens
        self._features: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.tokens = 0
        self.tower_runs = 0  # forwards of the vision tower
        self.images_encoded = 0
        self.hits = 0

    def features(self, images: list[ProcessedImage]) -> dict[str, torch.Tensor]:
        """Placeholder embeddings [num_tokens, hidden] of each image, by hash; one tower forward for all misses."""
        wanted = {im.content_hash: im for im in images}
        missing = [im for h, im in wanted.items() if h not in self._features]
        self.hits += len(wanted) - len(missing)
        if missing:
            self.tower_runs += 1
            self.images_encoded += len(missing)
            for im, feats in zip(missing, encode_images(self.model, missing)):
                self._features[im.content_hash] = feats
                self.tokens += feats.shape[0]
        for h in wanted:
            self._features.move_to_end(h)
        out = {h: self._features[h] for h in wanted}
        while self.tokens > self.max_tokens:
            oldest = next(iter(self._features))
            if oldest in wanted:
                break  # everything older is gone; this step's images stay even past the budget
            self.tokens -= self._features.pop(oldest).shape[0]
        return out

    def clear(self) -> None:
        self._features.clear()
        self.tokens = 0
