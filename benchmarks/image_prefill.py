"""Image vs text prefill: what one image costs against a text prompt of the same token count.

One kimi_k3 checkpoint with a MoonViT tower (random weights, `make-model --vision`), one engine, prefix caching
off, one generated token. For each image side S (an S x S image is (S/28)^2 placeholder tokens) the same chat
prompt is timed (a) with the image, its encoder cache emptied first (tower + prefill), (b) with the image features
already cached (prefill alone), and (c) as text of exactly the same token count; a, b and c alternate within each
repeat so machine noise hits all three alike. Reported: medians, the image / text ratio (a / c) and the tower's
share ((a - b) / a). `--model embedded` times the shipped kestrel-mini instead (112-px images, as it was trained on;
its image requests also run on its vision adapter, text ones do not).

    .venv/bin/python benchmarks/image_prefill.py --threads 2 --sides 224,448 --repeats 5
    .venv/bin/python benchmarks/image_prefill.py --threads 1 --model embedded --sides 112,224
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from report import write_result

from kestrel import LLM, SamplingParams
from kestrel.chat_template import render_chat
from kestrel.engine.vision_adapter import VISION_ADAPTER
from kestrel.models.builtin import EMBEDDED_DIR
from kestrel.models.checkpoint import make_model
from kestrel.models.loader import param_count

RESULTS = Path(__file__).resolve().parent / "results" / "image_prefill.json"
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def timed(llm: LLM, ids: list[int], images) -> float:
    t0 = time.perf_counter()
    llm.generate([ids], ONE_TOKEN, use_tqdm=False, images=[images])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", default="small", choices=["tiny", "small"], help="text model and tower preset")
    ap.add_argument("--sides", default="224,448", help="image sides in pixels (multiples of 28)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=None, help="a checkpoint with a tower, or 'embedded' (default: a random one)")
    ap.add_argument("--out", type=Path, default=None, help="default: results/image_prefill[_MODEL].json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            path, name = make_model("kimi_k3", args.size, Path(tmp) / "k3v", seed=0, vision=args.size), args.size
        else:
            path, name = (EMBEDDED_DIR, "kestrel-mini") if args.model == "embedded" else (Path(args.model), args.model)
        llm = LLM(str(path), max_total_tokens=16384, enable_prefix_caching=False, chunked_prefill_size=-1)
        model = llm.engine.model
        tower = param_count(model.vision_tower) + param_count(model.mm_projector)
        adapter = " + vision adapter" if VISION_ADAPTER in llm.engine.lora_names else ""
        print(f"model: {name}, {param_count(model) / 1e6:.1f}M parameters ({tower / 1e6:.2f}M tower{adapter})")
        rows = []
        for side in (int(s) for s in args.sides.split(",")):
            picture = Image.fromarray(np.random.default_rng(side).integers(0, 256, (side, side, 3), dtype=np.uint8))
            chat = [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "Describe it."}]}]
            ids, images = llm.image_prompt(render_chat(chat), [picture])
            text = [int(t) for t in torch.randint(3, 250, (len(ids),), generator=torch.Generator().manual_seed(side))]
            cold, warm, plain = [], [], []
            timed(llm, ids, images)  # warm-up
            for _ in range(args.repeats):
                llm.engine.runner.encoder_cache.clear()
                cold.append(timed(llm, ids, images))
                warm.append(timed(llm, ids, images))
                plain.append(timed(llm, text, None))
            a, b, c = (statistics.median(x) for x in (cold, warm, plain))
            rows.append(
                dict(
                    side=side,
                    prompt_tokens=len(ids),
                    image_tokens=images[0].num_tokens,
                    patches=images[0].pixel_values.shape[0],
                    image_ms=a * 1e3,
                    image_cached_features_ms=b * 1e3,
                    text_ms=c * 1e3,
                    image_over_text=a / c,
                    tower_share=(a - b) / a,
                )
            )
        print(
            f"\n{'side':>5} {'tokens':>6} {'patches':>7} {'image ms':>9} {'cached ms':>9} {'text ms':>8} "
            f"{'img/text':>8} {'tower':>6}"
        )
        for r in rows:
            print(
                f"{r['side']:>5} {r['prompt_tokens']:>6} {r['patches']:>7} {r['image_ms']:>9.1f} "
                f"{r['image_cached_features_ms']:>9.1f} {r['text_ms']:>8.1f} {r['image_over_text']:>8.2f} "
                f"{r['tower_share']:>6.0%}"
            )
        out = args.out or (
            RESULTS if args.model is None else RESULTS.with_name(f"image_prefill_{Path(name).name}.json")
        )
        write_result(out, "image_prefill", size=name, tower_params=tower, repeats=args.repeats, rows=rows)


if __name__ == "__main__":
    main()
