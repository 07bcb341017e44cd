"""Named training recipes: the model shape, the data sizes and the optimiser settings, all in one place."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kestrel.models.builtin import TIED_DIR
from kestrel.train.data import MINI_MIX, RANDOM_COPY_DRILLS, WIDE_MIX, Source
from kestrel.train.grpo import ClipConfig
from kestrel.train.rl import RLConfig
from kestrel.train.rl_tasks import (
    FRAMED_WIDE_TASKS,
    MINI_TASKS,
    PARITY_TASKS,
    READING_WIDE_TASKS,
    WIDE_TASKS,
    WORDS_WIDE_TASKS,
    TaskMix,
)
from kestrel.train.sft import SFTConfig
from kestrel.train.vision_pretrain import TowerPretrain


def k3_mini_config(
    vocab_size: int, hidden: int = 256, layers: int = 8, experts: int = 8, tie_embeddings: bool = False
) -> dict[str, Any]:
    """A K3.1-shaped config: KDA + DSA (indexer, small top-k), latent MoE, SiTU, AttnRes, MLA output gate.

    `tie_embeddings` shares the LM head with the embedding: copying a token then needs one identity-like map instead
    of every output row learning its token separately (benchmarks/copy_circuit.py measures the difference).
    """
    full = [i for i in range(1, layers + 1) if i % 4 == 0]
    text = {
        "model_type": "kimi_k3_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": hidden // 2,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 64,
        "num_experts": experts,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.0,
        "routed_expert_hidden_size": hidden // 2,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 8.0,
        "attn_res_block_size": 2,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie_embeddings,
        "model_max_length": 4096,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, layers + 1) if i not in full],
            "full_attn_layers": full,
            "head_dim": 64 if hidden >= 128 else 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
    }
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": None,
        "tie_word_embeddings": tie_embeddings,
    }


@dataclass
class VisionMix:
    """The synthetic visual task mixed into a recipe (kestrel/train/vision_data.py) and the tower that reads it."""

    episodes: int  # vision episodes added to the text ones (train); eval gets eval_episodes // 4
    hidden: int = 64
    layers: int = 3
    heads: int = 4
    intermediate: int = 128


def with_vision_tower(config: dict[str, Any], mix: VisionMix, image_token_id: int) -> dict[str, Any]:
    """A recipe's model config plus a MoonViT tower (8x8 position table: a 112-px image is 8x8 patches)."""
    vision = {
        "model_type": "kimi_k25_vision",
        "patch_size": 14,
        "pos_emb_height": 8,
        "pos_emb_width": 8,
        "pos_emb_time": 4,
        "num_attention_heads": mix.heads,
        "num_hidden_layers": mix.layers,
        "hidden_size": mix.hidden,
        "intermediate_size": mix.intermediate,
        "merge_kernel_size": [2, 2],
        "hidden_act": "gelu_pytorch_tanh",
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    }
    top = {"projection_hidden_size": mix.hidden, "projection_layer_norm_eps": 1e-5, "image_token_id": image_token_id}
    return config | {"vision_config": vision} | top


@dataclass
class Recipe:
    name: str
    hidden: int
    layers: int
    experts: int
    vocab_target: int
    train_episodes: int
    eval_episodes: int
    sft: SFTConfig = field(default_factory=SFTConfig)
    data: tuple[Source, ...] = MINI_MIX  # the weighted text episode sources; add one to widen the mix
    vision: VisionMix | None = None  # the visual task and its tower, added on top of the text mix
    tie_embeddings: bool = False  # LM head = embedding (copying forms far sooner: benchmarks/copy_circuit.py)
    # Continue from this model's weights, config and tokenizer ("kestrel-mini": the embedded one) instead of a fresh
    # tokenizer and random weights: what it already knows is not paid for again in this recipe's budget.
    init_from: str | None = None


def copy_probe(name: str, tie_embeddings: bool) -> Recipe:
    """kestrel-mini's shape on fresh pseudo-word drills only, short sequences in big batches (own SFTConfig each:
    `run_sft` edits it in place)."""
    return Recipe(
        name,
        hidden=256,
        layers=8,
        experts=8,
        vocab_target=2048,
        train_episodes=60000,
        eval_episodes=64,
        sft=SFTConfig(
            steps=3000, batch_size=48, lr=2e-3, warmup_steps=30, eval_every=50, save_every=50, max_minutes=20
        ),
        data=(RANDOM_COPY_DRILLS,),
        tie_embeddings=tie_embeddings,
    )


def mini_recipe(name: str, copy_fixes: bool) -> Recipe:
    """kestrel-mini's shape and 37-minute schedule; `copy_fixes` adds the tied head, 200 dense warm-up steps and
    fresh-pseudo-word drills, on a schedule they need: 2,000 steps with a 60-minute cap (at 37 minutes they scored
    below the untied model everywhere). Own SFTConfig each: `run_sft` edits it in place."""
    return Recipe(
        name,
        hidden=256,
        layers=8,
        experts=8,
        vocab_target=2048,
        train_episodes=60000,
        eval_episodes=256,
        sft=SFTConfig(
            steps=2000 if copy_fixes else 1200,
            batch_size=16,
            lr=2e-3,
            warmup_steps=40,
            eval_every=100,
            save_every=100,
            max_minutes=60 if copy_fixes else 37,
            save_dtype="bfloat16",
            dense_warmup_steps=200 if copy_fixes else 0,
        ),
        data=(*MINI_MIX, replace(RANDOM_COPY_DRILLS, weight=0.2)) if copy_fixes else MINI_MIX,
        tie_embeddings=copy_fixes,
    )


def mini_continued() -> Recipe:
    """The shipped kestrel-mini, trained further on today's wider mix plus fresh-pseudo-word drills, its DSA layers
    dense while their indexers re-distil (the shipped indexers were distilled sparse from step 0), 37 minutes."""
    recipe = mini_recipe("mini-continued", copy_fixes=True)
    recipe.tie_embeddings = False  # the base's own (untied) head
    recipe.init_from = "kestrel-mini"
    recipe.sft.lr, recipe.sft.warmup_steps, recipe.sft.dense_warmup_steps = 1e-3, 20, 150
    recipe.sft.steps, recipe.sft.max_minutes = 1200, 37  # the embedded model's own budget
    return recipe


def mini_wide() -> Recipe:
    """The tied candidate trained further on the wider arithmetic phrasings (`WIDE_MIX`, copy drills kept), at half
    its peak learning rate with no dense warm-up (its indexers already re-distilled): GRPO's base when the sub
    phrasings it misread are the gap (README: GRPO). Step-budgeted: a loaded machine trains the same model."""
    recipe = mini_recipe("mini-wide", copy_fixes=True)
    recipe.init_from = str(TIED_DIR)
    recipe.data = (*WIDE_MIX, replace(RANDOM_COPY_DRILLS, weight=0.2))
    recipe.sft.lr, recipe.sft.warmup_steps, recipe.sft.dense_warmup_steps = 1e-3, 20, 0
    recipe.sft.steps, recipe.sft.max_minutes = 600, None
    return recipe


RECIPES = {
    # The embedded model: trained by `kestrel train sft --recipe mini` within 40 minutes on 2 CPU cores.
    "mini": mini_recipe("mini", copy_fixes=False),
    # kestrel-mini with both copy fixes: LM head tied, DSA dense warm-up, fresh-pseudo-word drills in the mix, 2,000
    # steps. Its run is kestrel/assets/kestrel-mini-tied, the candidate base for GRPO (README: "The tied candidate").
    "mini-tied": mini_recipe("mini-tied", copy_fixes=True),
    # The shipped kestrel-mini trained further on the wider mix with the copy drills and the dense warm-up
    # (README: "Continuing the shipped model instead"; not shipped: arithmetic rose, tool calls and no_tool did not).
    "mini-continued": mini_continued(),
    # The tied candidate, 600 steps more on the wider arithmetic phrasings (README: GRPO, "Wider phrasings").
    "mini-wide": mini_wide(),
    # The visual task at a small scale, with some text data mixed in: what `kestrel eval --task vision` reaches in
    # a short CPU run (the README gives the figures).
    "vision-small": Recipe(
        "vision-small",
        hidden=128,
        layers=4,
        experts=4,
        vocab_target=1024,
        train_episodes=1500,
        eval_episodes=32,
        sft=SFTConfig(
            steps=500, batch_size=16, lr=3e-3, warmup_steps=20, eval_every=125, save_every=50, max_minutes=40
        ),
        vision=VisionMix(episodes=12000),
    ),
    # The copy-circuit probe: kestrel-mini's shape on fresh pseudo-word drills only (nothing to memorise), short
    # sequences in big batches; `kestrel eval --task copy` says whether copying formed (README: figures).
    "copy-probe": copy_probe("copy-probe", tie_embeddings=False),
    # The same probe with the LM head tied to the embedding, the arm benchmarks/copy_circuit.py points to.
    "copy-probe-tied": copy_probe("copy-probe-tied", tie_embeddings=True),
    # Seconds-scale run for tests.
    "tiny": Recipe(
        "tiny",
        hidden=64,
        layers=4,
        experts=4,
        vocab_target=512,
        train_episodes=2000,
        eval_episodes=64,
        sft=SFTConfig(steps=60, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=30, save_every=1000),
    ),
    "tiny-vision": Recipe(
        "tiny-vision",
        hidden=64,
        layers=4,
        experts=4,
        vocab_target=512,
        train_episodes=400,
        eval_episodes=32,
        sft=SFTConfig(steps=12, batch_size=8, lr=3e-3, warmup_steps=2, eval_every=6, save_every=1000),
        vision=VisionMix(episodes=400, hidden=32, layers=1, heads=2, intermediate=64),
    ),
}


@dataclass
class VisionStage:
    """One stage-1 run: the tower's shape, how many episodes, and the optimiser (text weights frozen).

    `lora_rank` > 0 also trains a LoRA adapter on the frozen language model's attention and dense / shared-expert
    projections (`VISION_LORA_TARGETS`; routed experts and router untouched): a frozen tiny decoder barely reads
    image features, an adapter helps it (Phi-4-multimodal ships its vision LoRA the same way, beside the base).
    `pretrain` first trains the tower as a classifier of the same images, without the decoder; stage 1 then keeps
    that tower frozen (projector and adapter learn), as LLaVA does."""

    tower: VisionMix
    eval_episodes: int
    sft: SFTConfig = field(default_factory=SFTConfig)
    lora_rank: int = 0
    pretrain: TowerPretrain | None = None  # tower pretraining as a classifier first (`kestrel.train.vision_pretrain`)
    # The kinds of stage 1's training stream, in turn: the decoder learns to read two-digit numbers last (colour,
    # shape and count were at 92-100% when numbers were at 52%), so numbers get a double share. Eval stays balanced.
    train_kinds: tuple[str, ...] = ("color", "shape", "count", "number")


# The projections a vision stage's adapter trains (PEFT's target_modules). gate/up/down also name the routed
# experts' projections: `vision_adapter` leaves those out.
VISION_LORA_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


VISION_STAGES = {
    # `kestrel train vision` (kestrel/train/vision_stage.py): the stage the shipped seeing kestrel-mini comes from.
    # Step-budgeted, so a loaded machine trains the same model, only slower (62 min on 2 cores: 23 + 39): the tower
    # pretrains as a classifier, then stays frozen while projector and a rank-16 adapter learn.
    "mini": VisionStage(
        VisionMix(episodes=40000, hidden=128, layers=4, heads=4, intermediate=256),
        eval_episodes=64,
        sft=SFTConfig(
            steps=2400,
            batch_size=16,
            lr=2e-3,
            warmup_steps=20,
            eval_every=200,
            save_every=50,
            max_minutes=None,
            save_dtype="bfloat16",
            freeze_text=True,
        ),
        lora_rank=16,
        pretrain=TowerPretrain(steps=2200),
        train_kinds=("color", "shape", "count", "number", "number"),
    ),
    # Seconds-scale run for tests.
    "tiny": VisionStage(
        VisionMix(episodes=64, hidden=32, layers=1, heads=2, intermediate=64),
        eval_episodes=8,
        sft=SFTConfig(steps=4, batch_size=4, lr=2e-3, warmup_steps=1, eval_every=4, save_every=2, freeze_text=True),
    ),
}


@dataclass
class RLRecipe:
    """A GRPO run: its tasks, its settings, and the base it adapts (a folder; None: the embedded kestrel-mini)."""

    name: str
    tasks: TaskMix
    config: RLConfig
    model: str | None = None


# Where `kestrel train sft --recipe mini-wide` writes its model (its default --out): the wide RL recipes' base.
WIDE_BASE = "out/sft-mini-wide/checkpoint"


def mini_rl_config() -> RLConfig:
    """The mini RL recipes' settings (a fresh object each: a run may edit its copy)."""
    return RLConfig(
        steps=21,
        prompts_per_step=32,
        samples_per_prompt=16,
        minibatches=1,
        max_new_tokens=160,
        temperature=0.7,
        lr=2e-3,
        clip=ClipConfig(clip_low=0.2, clip_high=0.28, tis_cap=2.0, kl_coef=0.1),
        eval_every=6,
        eval_n=25,
        max_minutes=40,
        threads=2,
        engine_threads=1,
        engines=2,  # one engine a core while the trainer waits (benchmarks/rl_engines.py)
    )


def anchored_rl_config() -> RLConfig:
    """The mini settings with rl22's KL: 1.0 (at 0.1 a token's KL gradient is ~1% of the policy gradient's), also on
    half the zero-variance groups (`kl_anchor_share`), which dynamic filtering would drop."""
    cfg = mini_rl_config()
    return replace(cfg, kl_anchor_share=0.5, clip=replace(cfg.clip, kl_coef=1.0))


RL_RECIPES = {
    # The shipped adapter: `kestrel rl --recipe mini --ship`, within 40 minutes on 2 CPU cores (the trainer on both
    # while the engine, on one, waits: they take turns). Its base is the tied retrain, the first kestrel-mini whose
    # tool calls copy arguments (so a call can earn a reward). The setting measured best (README: GRPO): 32 prompts
    # x 16 samples a step (more groups with reward variance, better advantage estimates), one on-policy AdamW step,
    # rollouts at T 0.7 (fewer sampling slips in long traces and copied arguments), lr 2e-3 with a k3 KL of 0.1 to
    # the base; 21 steps (37 minutes measured, evaluations included), so the run does not depend on the time cap.
    "mini": RLRecipe(
        "mini",
        MINI_TASKS,
        mini_rl_config(),
        model=str(TIED_DIR),
    ),
    # The shipped recipe with step credit: a wrong trace blamed from its first false step on, its right steps before
    # it left alone (`kestrel.train.step_credit`; run rl27 in the README).
    "mini-step": RLRecipe("mini-step", MINI_TASKS, replace(mini_rl_config(), step_credit=True), model=str(TIED_DIR)),
    # The same run on the base `kestrel train sft --recipe mini-wide` writes (its default --out), asked in that base's
    # wider SFT phrasings too: run rl19 in the README (not shipped).
    "mini-wide": RLRecipe("mini-wide", WIDE_TASKS, mini_rl_config(), model=WIDE_BASE),
    # rl19's run with its questions framed by RL's own prefixes and suffixes (run rl21 in the README, not shipped).
    "mini-wide-framed": RLRecipe("mini-wide-framed", FRAMED_WIDE_TASKS, mini_rl_config(), model=WIDE_BASE),
    # rl22's run (rl19 with half the zero-variance groups held by a KL of 1.0) with add2 and sub also asked in the
    # frames the wide base misreads (run rl23 in the README, not shipped).
    "mini-wide-reading": RLRecipe("mini-wide-reading", READING_WIDE_TASKS, anchored_rl_config(), model=WIDE_BASE),
    # rl23's run with mul and sub also asked with the operation words the wide base misreads (run rl26, not shipped).
    "mini-wide-words": RLRecipe("mini-wide-words", WORDS_WIDE_TASKS, anchored_rl_config(), model=WIDE_BASE),
    # Seconds-scale run of the same loop on any checkpoint (tests, smoke runs): reward = mostly even token ids.
    "tiny": RLRecipe(
        "tiny",
        PARITY_TASKS,
        RLConfig(
            steps=3,
            prompts_per_step=4,
            samples_per_prompt=4,
            minibatches=2,
            max_new_tokens=8,
            temperature=0.8,  # exercises the tempered policy (the engine reports raw logprobs)
            lr=2e-2,
            clip=ClipConfig(kl_coef=0.05),  # exercises the reference pass (the base: the adapter switched off)
            lora_rank=4,
            lora_alpha=8.0,
            lora_targets=("q_proj", "o_proj", "gate_proj"),
            eval_every=2,
            eval_n=2,
            save_every=1,
        ),
    ),
}
