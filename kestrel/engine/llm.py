"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from kestrel.engine.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.outputs import RequestOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.vision.inputs import expand_placeholders
from kestrel.models.vision.preprocess import ProcessedImage, preprocess_image


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_name: str | list[str | None] | None = None,
        images: list[list[ProcessedImage] | None] | None = None,
        return_routed_experts: bool = False,
        return_indexer_topk: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. `lora_name`: a loaded adapter for
        every prompt, or one per prompt (None: the base). `images`: per prompt, the images of its placeholder
        runs (see `Engine.add_request`, and `LLM.image_prompt` for a chat prompt with images). `return_*`: rollout
        capture (see `Engine.add_request`)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("sampling_params: need one per prompt")
        loras = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_name: need one per prompt")
        per_images = images if images is not None else [None] * len(prompts)
        if len(per_images) != len(prompts):
            raise ValueError("images: need one list (or None) per prompt")
        capture = dict(return_routed_experts=return_routed_experts, return_indexer_topk=return_indexer_topk)
        ids = [
            self.engine.add_request(p, sp, lora_name=lo, images=im, **capture)
            for p, sp, lo, im in zip(prompts, per_prompt, loras, per_images)
        ]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished:
                for out in self.engine.step().finished:
                    results[out.request_id] = out
                    bar.update(1)
        return [results[i] for i in ids]

    def image_prompt(self, text: str, images: list) -> tuple[list[int], list[ProcessedImage]]:
        """A rendered chat prompt with one image marker per image (PIL images) → token ids with each image's
        placeholder run, and the preprocessed images to pass to `generate`."""
        vision = self.engine.model_config.vision
        if vision is None:
            raise ValueError("images: this model has no vision tower; it takes text only")
        processed = [preprocess_image(im, vision) for im in images]
        return expand_placeholders(self.engine.encode(text), processed, vision.image_token_id), processed

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def close(self) -> None:
        """Flush the disk tier of the prefix cache (write_back policy); the engine stays usable."""
        self.engine.close()
