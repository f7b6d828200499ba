"""The words the Train and LLM forms show for each config field: a short label, a one-line description in
user terms, the group it belongs to (what the user is deciding) and whether it is shown on top (common) or
folded into its group's "more" section.

The schema's descriptions (core/config.py) are for the config file and the CLI; these are their plain
versions for the page. A field missing here still shows (with a label made from its name, in its section's
group, folded); tests/ui/test_ui.py asks every field the forms show to have its own entry.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# The groups, in the order the form shows them.
GROUPS = ("Model", "Dataset", "What to learn", "How long", "Speed and memory", "Previews", "Saving and output")


@dataclass(frozen=True)
class Label:
    text: str           # the field's label
    group: str          # one of GROUPS
    common: bool        # shown on top; else folded into the group's "more" section
    help: str           # one line, in user terms


def _l(text: str, group: str, help: str, common: bool = False) -> Label:
    return Label(text, group, common, help)


M, D, W, H, S, P, O = GROUPS

# The words a tick box shows for a value of a list field's fixed choices (train.trackers).
CHOICE_WORDS = {"tensorboard": "TensorBoard", "wandb": "Weights & Biases (offline)"}


LABELS: dict[str, Label] = {
    # ---- presets, shown above the groups
    "card": _l("Card preset", M, "Your card's memory: the planner picks the fastest settings that fit; each "
               "choice shows its memory peak and time per image.", common=True),
    "goal": _l("Goal preset", M, "What you are teaching (a character, a style, a concept): fills rank, "
               "learning rate, layers and caption dropout.", common=True),
    # ---- model
    "model.path": _l("Base model", M, "The model the adapter is trained on.", common=True),
    "model.tokenizer": _l("Tokenizer folder", M, "Only for a single-file checkpoint: a model folder whose "
                          "tokenizers it should use."),
    "model.prediction_type": _l("What the model predicts", M, "Leave on auto unless your model's own settings "
                                "are wrong (auto reads them)."),
    "model.quantize": _l("Compress the base model", M, "Keep the frozen base model compressed in memory "
                         "(QLoRA): much less memory, slightly slower steps."),
    "model.quantize_convs": _l("Also compress its convolutions", M, "Compress the base model's convolution "
                               "layers too: less memory, a little less precise."),
    "model.tiled_vae_encode": _l("Prepare images in tiles", M, "Encode large images in pieces when preparing "
                                 "them: far less memory, tiny differences at the seams."),
    "model.quant_double": _l("Compress the compression scales too", M, "Saves a little more memory with the "
                             "compact compression formats."),
    "model.quant_compute_dtype": _l("Compute precision of compressed layers", M, "Auto follows the training "
                                    "precision."),
    # ---- dataset
    "data.dirs": _l("Image folders", D, "Folders of images with a caption file beside each.", common=True),
    "data.trigger_word": _l("Trigger word", D, "The word that calls your concept up; added to the start of "
                            "captions that lack it.", common=True),
    "data.resolution": _l("Training resolution", D, "Image size to train at; empty uses the model's own.",
                          common=True),
    "data.class_token": _l("What it is", D, "The kind of thing your concept is (a dog, a style): the caption "
                           "of images that have none, after the trigger word."),
    "data.caption_extension": _l("Caption file extension", D, "How caption files end, beside each image."),
    "data.bucket_step": _l("Size step of image buckets", D, "Images are grouped by shape; bucket sides are "
                           "multiples of this many pixels."),
    "data.max_aspect": _l("Most elongated shape", D, "The longest side over the shortest that a bucket may "
                          "have."),
    "data.crop": _l("Crop position", D, "Where an image is cropped to fit its bucket."),
    "data.flip": _l("Mirror images", D, "Flip images left to right at random (not for text or one-sided "
                    "subjects)."),
    "data.small_images": _l("Small images", D, "What to do with images much smaller than the training size."),
    "data.min_size_fraction": _l("What counts as small", D, "Images below this share of the training size "
                                 "count as small."),
    "data.max_pixels": _l("Largest image accepted (pixels)", D, "Bigger images are refused, a guard against "
                          "broken or hostile files."),
    "data.min_side": _l("Shortest side accepted (pixels)", D, "Images with a shorter side are skipped."),
    "data.shuffle_tags": _l("Shuffle caption tags", D, "Mix the order of a caption's comma-separated tags each "
                            "time it is used."),
    "data.keep_tokens": _l("Tags kept in place", D, "When shuffling: how many leading tags stay first."),
    "data.caption_dropout": _l("Empty-caption share", D, "How often an image trains with no caption, which "
                               "keeps prompts without your word working."),
    "data.tag_dropout": _l("Tag dropout", D, "How often each caption tag is left out, so no single tag carries "
                           "the concept."),
    "data.keep_tokens_separator": _l("Keep-in-place marker", D, "Tags before this marker in a caption stay first "
                                     "and are never dropped."),
    "data.wildcards": _l("Caption choices", D, "Pick one of the choices in braces in a caption each time it is "
                         "used, for variety."),
    "data.caption_prefix": _l("Caption start", D, "Text added before every caption."),
    "data.caption_suffix": _l("Caption end", D, "Text added after every caption."),
    "data.datasets": _l("Per-dataset settings", D, "One row per picked folder; an empty cell uses the run's "
                        "setting. Tick regularization for class images (they never get the trigger word)."),
    "data.validation_split": _l("Held-out share for validation", D, "Share of images kept aside to measure "
                                "how well the adapter generalises; zero keeps none."),
    "data.cache_dir": _l("Cache folder", D, "Where prepared images and captions are kept between runs."),
    "data.masked_loss": _l("Use masks", D, "Learn only where each image's grey mask is white; black areas "
                           "are ignored."),
    "data.mask_suffix": _l("Mask name ending", D, "What a mask's file name adds to its image's name."),
    # ---- what to learn
    "adapter.kind": _l("Adapter kind", W, "lora is the usual; dora often learns closer to full fine-tuning; "
                       "loha and lokr are compact alternatives.", common=True),
    "adapter.preset": _l("Layers to adapt", W, "Which parts of the model learn: attention only, cross-attention "
                         "only, attention weighted by layer, or everything.", common=True),
    "adapter.rank": _l("Adapter size (rank)", W, "Bigger learns more detail and makes a bigger file; smaller "
                       "generalises more.", common=True),
    "adapter.alpha": _l("Adapter strength (alpha)", W, "Scales what the adapter learned; empty means the same "
                        "as the rank."),
    "adapter.dropout": _l("Adapter dropout", W, "Randomly drop part of the adapter's input while training, "
                          "against overfitting."),
    "adapter.scale_rank_with_resolution": _l("Scale size with resolution", W, "Give the adapter more rank at "
                                             "higher training resolutions and less at lower."),
    "adapter.min_rank": _l("Smallest layer rank", W, "No layer's rank goes below this."),
    "adapter.max_rank": _l("Largest layer rank", W, "No layer's rank goes above this."),
    "adapter.overrides": _l("Per-layer ranks", W, "Set the rank of chosen layers by name pattern; zero leaves "
                            "a layer out."),
    "adapter.conv_rank": _l("Convolution adapter size", W, "With the locon layers: the rank of the "
                            "convolution layers' adapters; empty means the adapter size."),
    "adapter.conv_alpha": _l("Convolution adapter strength", W, "With the locon layers: their alpha; empty "
                             "means the same as their size."),
    "adapter.rslora": _l("Rank-stabilised scaling", W, "Scale each adapter by its rank's square root, which "
                         "keeps large ranks learning."),
    "adapter.lokr_factor": _l("LoKr factor size", W, "With lokr: the size of its small factor; empty picks one "
                              "near the square root."),
    "adapter.init": _l("How the adapter starts", W, "default starts from zero; pissa and olora from the "
                       "weights themselves; loftq from a compressed base's error."),
    "adapter.lora_bias": _l("Learn a bias too", W, "Add a trainable bias to each adapter layer."),
    "adapter.rank_budget": _l("Parameter budget", W, "Share a total number of trainable parameters between "
                              "layers by how much each matters; empty: no budget."),
    "adapter.rank_budget_mb": _l("Adapter file budget (MB)", W, "The same budget as a file size; empty: no "
                                 "budget."),
    "adapter.calibration_batches": _l("Batches to measure layers on", W, "With a budget: how many batches "
                                      "measure which layers matter."),
    "adapter.rank_schedule": _l("Shrink the adapter at steps", W, "At the given steps the adapter shrinks to "
                                "the given rank; the saved file has the final sizes."),
    "adapter.train_text_encoder": _l("Also train the text encoders", W, "Adapt how prompts are read too; "
                                     "slower, since captions are then encoded every step."),
    "adapter.text_encoder_rank": _l("Text encoder adapter size", W, "Rank of the text encoders' adapters; "
                                    "empty means the adapter size."),
    "train.prior_loss_weight": _l("Regularization weight", W, "How much the regularization images count beside "
                                  "your own."),
    "train.prior_prediction": _l("Keep the base model's answers", W, "For regularization images, learn the base "
                                 "model's own prediction instead of their noise."),
    "train.loss": _l("Loss", W, "How errors are measured: the usual squared error, or huber, which lets odd "
                     "images pull less."),
    "train.huber_delta": _l("Huber threshold", W, "With huber: how far off an error may be before it counts "
                            "less."),
    "train.noise_offset": _l("Noise offset", W, "Helps the model learn very dark or very bright images; zero "
                             "is off."),
    "train.min_snr_gamma": _l("Min-SNR weighting", W, "Balances the loss across noise levels, often faster "
                              "learning; zero is off."),
    "train.debiased_estimation": _l("Debiased estimation", W, "Weights the loss towards the noisier steps "
                                    "(kohya's debiased estimation); off by default."),
    "train.multires_noise_iterations": _l("Multi-resolution noise", W, "Adds coarse noise layers so the model can "
                                          "change overall colours and layout; zero is off."),
    "train.multires_noise_discount": _l("Multi-resolution noise discount", W, "How much each coarser noise layer "
                                        "counts; lower: less."),
    "train.ip_noise_gamma": _l("Input perturbation", W, "Shows the model slightly noisier images than the noise it "
                               "predicts, which can sharpen results; zero is off."),
    "train.zero_terminal_snr": _l("Zero terminal SNR", W, "Rescale the noise schedule so the noisiest step is "
                                  "pure noise (for v-prediction models)."),
    "train.timestep_min": _l("Lowest noise level", W, "The least noisy timestep trained on."),
    "train.timestep_max": _l("Highest noise level", W, "The noisiest timestep trained on; empty: the last."),
    # ---- how long
    "train.steps": _l("Training steps", H, "How many times the adapter is updated; more steps learn more.",
                      common=True),
    "train.epochs": _l("Training epochs", H, "Train this many passes over the images instead of a number of "
                       "steps (each folder's repeats counted); empty: the steps."),
    "train.batch_size": _l("Batch size", H, "Examples per step: bigger batches are smoother and need more "
                           "memory.", common=True),
    "train.lr": _l("Learning rate", H, "How big each update is: too high breaks images, too low learns "
                   "nothing.", common=True),
    "train.grad_accum": _l("Gradient accumulation", H, "Add up several batches per step: a bigger effective "
                           "batch in the same memory."),
    "train.unet_lr": _l("Image model learning rate", H, "The image model's adapters' rate; empty: the learning "
                        "rate."),
    "train.text_encoder_lr": _l("Text encoder learning rate", H, "The text encoders' adapters' rate; empty: "
                                "the learning rate."),
    "train.loraplus_ratio": _l("LoRA+ ratio", H, "Give each adapter's second half this many times the learning "
                               "rate; empty or one is off."),
    "train.lr_multipliers": _l("Per-layer learning rate factors", H, "Multiply the learning rate of chosen "
                               "layers by name pattern."),
    "train.optimizer": _l("Optimizer", H, "adamw is safe; prodigy wants a rate of one; schedule-free wants no "
                          "schedule, a higher rate; came saves memory."),
    "train.weight_decay": _l("Weight decay", H, "Pulls the adapter's weights gently towards zero, against "
                             "overfitting."),
    "train.scheduler": _l("Learning rate schedule", H, "How the learning rate changes over the run."),
    "train.scheduler_cycles": _l("Restarts", H, "Cosine with restarts: how many cycles."),
    "train.scheduler_power": _l("Decay power", H, "Polynomial schedule: how fast the rate decays (one is "
                                "linear)."),
    "train.warmup_steps": _l("Warmup steps", H, "Steps over which the learning rate ramps up from zero."),
    "train.max_grad_norm": _l("Gradient clipping", H, "Limits how big one update can be; zero is off."),
    "train.seed": _l("Seed", H, "The same seed and settings give the same run."),
    "train.nan_guard": _l("Skip broken steps", H, "Skip a step whose numbers blow up, and stop the run after "
                          "several in a row."),
    "train.max_nan_steps": _l("Broken steps before stopping", H, "With skipping on: how many in a row stop "
                              "the run."),
    "train.ema": _l("Average the weights (EMA)", H, "Keep a running average of the adapter, usually a smoother "
                    "result; the saved file uses it."),
    "train.ema_decay": _l("EMA decay", H, "Closer to one averages over more steps."),
    # ---- speed and memory
    "train.vram_gb": _l("GPU memory budget (GiB)", S, "The GPU memory the whole run may use: the fastest "
                        "settings that fit are chosen; empty: no budget.", common=True),
    "train.device": _l("Train on", S, "Auto uses a GPU when there is one, else the CPU.", common=True),
    "train.mixed_precision": _l("Precision", S, "Auto uses half precision on a GPU that supports it: faster "
                                "and smaller than full precision."),
    "train.gradient_checkpointing": _l("Save memory by recomputing", S, "Recompute intermediate results "
                                       "instead of keeping them: less memory, slower steps."),
    "train.checkpoint_budget_gb": _l("Memory budget for recomputing (GiB)", S, "Recompute only as much as "
                                     "needed to fit this much memory; empty: off."),
    "train.speed": _l("Speed-ups", S, "Auto turns on the GPU speed-ups that pay off for this run and says "
                      "which; off uses only those you set."),
    "train.channels_last": _l("Channels-last layout", S, "A memory layout that can make convolutions faster "
                              "on a GPU."),
    "train.compile": _l("Compile", S, "Compile the model's repeated blocks for faster steps; the first steps "
                        "take longer."),
    "train.compile_activation_budget": _l("Compiled memory share", S, "With compile: how much of the "
                                          "intermediate results to keep; empty lets the compiler choose."),
    "train.cuda_graphs": _l("CUDA graphs", S, "Replay each step's GPU work from a recording: faster steps on "
                            "a GPU."),
    "train.fuse_qkv": _l("Fuse attention projections", S, "Compute the attention inputs in one matmul "
                         "instead of three: the same result, faster."),
    "train.fused_geglu": _l("Fused feed-forward backward", S, "A faster GPU kernel for the feed-forward "
                            "layers, same result."),
    "train.lora_matmul": _l("Adapter matmul", S, "How the fused attention's adapter is computed; all give the "
                            "same result."),
    "train.sdpa_backend": _l("Attention kernel", S, "Default lets PyTorch choose the fastest one."),
    "train.gradient_sync": _l("Multi-GPU sync", S, "With several GPUs: how they share gradients; auto picks."),
    "train.profile_steps": _l("Profile steps", S, "Record this many steps to see where time goes; zero is "
                              "off."),
    "train.peak_tflops": _l("GPU peak speed (TFLOP/s)", S, "For the efficiency figure in the log; empty looks "
                            "your GPU up."),
    "llm.loss_chunk": _l("Loss chunk (tokens)", S, "Compute the loss in pieces of this many tokens; lower "
                         "saves memory."),
    "llm.offload_activations": _l("Layer inputs in CPU memory", S, "With gradient checkpointing: keep what "
                                  "the layers recompute from in CPU memory; less GPU memory."),
    "llm.offload_embeddings": _l("Embedding table in CPU memory", S, "Keep the table in CPU memory; only the "
                                 "tokens' rows reach the GPU each step; less GPU memory for a large vocabulary."),
    "llm.attn_implementation": _l("Attention kernel", S, "Which attention code the model uses; sdpa keeps "
                                  "packed examples apart."),
    # ---- previews
    "preview.prompts": _l("Preview prompts", P, "One prompt a line; as first shown: the model's own (another "
                          "model: a few of your captions); empty: no previews.", common=True),
    "preview.every": _l("Preview every (steps)", P, "Also render previews and measure the validation loss "
                        "this often; zero: only before and after.", common=True),
    "preview.every_epochs": _l("Preview every (epochs)", P, "Render previews and measure the validation loss "
                               "after every this many epochs instead; zero is off."),
    "preview.steps": _l("Preview sampling steps", P, "Sampling steps per preview image: more is cleaner and "
                        "slower."),
    "preview.vae_tiling": _l("Decode previews in tiles", P, "Much less memory for large previews, faint seams "
                             "possible; the memory budget turns it on when needed."),
    "preview.guidance": _l("Preview guidance", P, "How closely previews follow the prompt."),
    "preview.guidance_rescale": _l("Guidance rescale", P, "Tames over-bright previews at high guidance; empty "
                                   "picks one to suit the noise schedule."),
    "preview.seed": _l("Preview seed", P, "The same every time, so previews compare across steps."),
    "preview.before": _l("Preview before training", P, "Render previews first, as a baseline."),
    "preview.after": _l("Preview after training", P, "Render previews at the end."),
    "preview.concept": _l("Concept to score", P, "Score previews for a shape or colour (such as star); empty "
                          "is off."),
    "llm.preview_prompts": _l("Preview prompts", P, "One question a line, answered before and after training, to "
                              "see what changed.", common=True),
    "llm.max_new_tokens": _l("Longest preview answer (tokens)", P, "Preview answers stop after this many "
                             "tokens."),
    # ---- saving and output
    "output.name": _l("Run name", O, "The run's folder name; empty: the date and time.", common=True),
    "output.runs_dir": _l("Runs folder", O, "The folder that holds the runs."),
    "output.overwrite": _l("Replace a run of the same name", O, "Delete an existing run with this name first."),
    "train.save_every": _l("Save every (steps)", O, "Save the training state this often, to resume or pick a "
                           "step; zero is off."),
    "train.save_every_epochs": _l("Save every (epochs)", O, "Save the training state after every this many "
                                  "epochs instead of by steps; zero is off."),
    "train.save_every_minutes": _l("Save every (minutes)", O, "Also save this often, whichever comes first; "
                                   "zero is off."),
    "train.keep_checkpoints": _l("Saved states kept", O, "How many of the newest saved states are kept."),
    "train.log_every": _l("Log every (steps)", O, "How often the loss and speed are written to the log and the "
                          "dashboards (the progress line shows a recent step's between them)."),
    "train.trackers": _l("Dashboards", O, "Also send the figures, previews and settings to each one ticked: "
                         "TensorBoard, Weights and Biases (offline)."),
    "train.tensorboard": _l("TensorBoard logs", O, "Also write logs TensorBoard can show (as tensorboard among the "
                            "dashboards)."),
    "llm.merge": _l("Also save a merged model", O, "Write the base model with the adapter built in, at the "
                    "end."),
    # ---- the LLM task's data
    "llm.data": _l("Training files", D, "Instruction or chat files, one example a line.", common=True),
    "llm.format": _l("File format", D, "How the lines are read; auto tells instruction and chat lines apart.",
                     common=True),
    "llm.max_length": _l("Longest example (tokens)", D, "Longer examples are cut at the end (and reported).",
                         common=True),
    "llm.packing": _l("Pack short examples", D, "Fit several short examples into each row: faster, each still "
                      "learned on its own."),
    "llm.chat_template": _l("Chat template", D, "How conversations are laid out for the model; empty: the "
                            "model's own."),
    "llm.system_prompt": _l("System message", D, "Added to examples and preview prompts that have none."),
    "llm.validation_split": _l("Held-out share for validation", D, "Share of examples kept aside to measure "
                               "how well the adapter generalises; zero keeps none."),
}

# The per-dataset table's columns (the Train form's Per-dataset settings), by the field each one sets in a
# [[data.datasets]] table; the words follow the form's labels of the run-wide fields they override.
DATASET_COLUMNS: dict[str, str] = {"path": "folder", "repeats": "repeats", "trigger_word": "trigger word",
                                   "is_regularization": "regularization", "resolution": "resolution",
                                   "caption_dropout": "empty-caption share", "tag_dropout": "tag dropout",
                                   "keep_tokens": "kept leading tags", "caption_extension": "caption file extension"}


# The group of each section's fields that have no entry (a new schema field), until they get one.
SECTION_GROUP = {"model": M, "data": D, "adapter": W, "train": H, "preview": P, "output": O, "llm": D}


# Where the LLM form says it differently.
LLM_LABELS: dict[str, Label] = {
    "model.path": _l("Base model", M, "The language model the adapter is trained on.", common=True),
    "train.batch_size": _l("Batch size", H, "Rows per step: bigger batches are smoother and need more memory.",
                           common=True),
    "train.lr": _l("Learning rate", H, "How big each update is: too high garbles the answers, too low learns "
                   "nothing.", common=True),
    "adapter.preset": _l("Layers to adapt", W, "Which parts of the model learn: attention only, attention and "
                         "feed-forward weighted by kind, or all of them alike.", common=True),
}


def label_for(key: str, task: str = "sdxl") -> Label:
    """The field's label; a field without an entry gets one from its name, folded into its section's group."""
    if task == "llm" and key in LLM_LABELS:
        return LLM_LABELS[key]
    if key in LABELS:
        return LABELS[key]
    section, _, name = key.rpartition(".")
    return Label(name.replace("_", " ").capitalize(), SECTION_GROUP.get(section, O), False, "")


# ------------------------------------------------------------------------------------- messages in its words

# A config key as messages from the config, the planner or a writer name it: "train.steps", "data.dirs".
_KEY = re.compile(r"\b(?:model|data|adapter|train|preview|output|llm)\.[a-z][a-z0-9_]*\b")
# A key set to a value in such a message ("set train.fuse_qkv=true", "train.steps = -5").
_KEY_SET = re.compile(r"(set\s+|--set\s+)?'?(" + _KEY.pattern + r")\s*=\s*('[^']*'|\"[^\"]*\"|[^\s,;:)]+)'?")


def shown_label(key: str, task: str = "sdxl") -> str:
    """The label the page shows for config key `key`, quoted as messages quote it."""
    if key in LABELS or (task == "llm" and key in LLM_LABELS):
        return f"'{label_for(key, task).text}'"
    return key


def page_words(text: str, task: str = "sdxl") -> str:
    """A message from the config, the planner or a writer in the words of the page: each config key it names as
    the label the form shows (train.steps -> 'Training steps'), a key set on or off as the box to tick or untick."""
    def setting(m: re.Match) -> str:
        verb, key, value = m.group(1), m.group(2), m.group(3)
        label = shown_label(key, task)
        if label == key:
            return m.group(0)
        if value in ("true", "True"):
            return f"tick {label}"
        if value in ("false", "False"):
            return f"untick {label}"
        value = value.strip("'\"")
        return f"set {label} to {value}" if verb else f"{label} = {value}"

    text = _KEY_SET.sub(setting, text)
    return _KEY.sub(lambda m: shown_label(m.group(0), task), text)


def _number(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def must_words(err: dict, task: str = "sdxl") -> str:
    """What a validation error (pydantic's, or the form's own in that shape) asks of the value, in words."""
    kind, ctx, msg = err.get("type", ""), err.get("ctx") or {}, str(err.get("msg", ""))
    bounds = {"greater_than_equal": ("at least", "ge"), "greater_than": ("more than", "gt"),
              "less_than_equal": ("at most", "le"), "less_than": ("less than", "lt")}
    if kind in bounds:
        words, k = bounds[kind]
        return f"must be {words} {_number(ctx.get(k))}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "must be a whole number"
    if kind in ("float_parsing", "float_type", "finite_number"):
        return "must be a number"
    if kind in ("bool_parsing", "bool_type"):
        return "must be ticked or not"
    if kind == "missing":
        return "needs a value"
    if kind == "extra_forbidden":
        return "is not a setting of this form"
    return page_words(msg.removeprefix("Value error, ").removeprefix("Assertion failed, "), task)


def problem_words(err: dict, task: str = "sdxl") -> str:
    """One wrong value in the page's words: "'Training steps' must be at least 1, not -5"."""
    loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
    field = ""  # none: a section's own check (its loc is the section), or a field the form does not show
    if ".".join(loc).startswith("data.datasets"):
        field = f"'{label_for('data.datasets', task).text}'"
    else:
        # The longest labelled key the location starts with; what follows is an entry of that field's table
        # (Per-layer ranks' '*attn2*').
        for n in range(len(loc), 1, -1):
            key = ".".join(loc[:n])
            if shown_label(key, task) != key:
                rest = ".".join(loc[n:])
                field = shown_label(key, task) + (f" entry {rest!r}" if rest else "")
                break
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is None or err.get("type") == "missing" else \
        f", not {value!r}" if isinstance(value, str) else f", not {_number(value)}"
    said = must_words(err, task)
    if not field:
        return said[:1].upper() + said[1:]
    if err.get("type") in ("value_error", "assertion_error"):
        return f"{field}: {said}"
    return f"{field} {said}{shown}"


def error_words(e: BaseException, task: str = "sdxl") -> str:
    """An error about the form's settings in the page's words: each wrong value named by its label with what it
    must be; any other message with the config keys it names as labels."""
    problems = getattr(e, "problems", None)
    if problems:
        return "; ".join(problem_words(p, task) for p in problems)
    return page_words(str(e), task)
