"""Preview images: fixed-seed renders of the prompts file with diffusers' SDXL pipeline, with the step
in the file name and a grid of all prompts, so images at different steps compare like for like.

A prompts file is text, one prompt per line with kohya's per-line options (`a cat --n blurry --w 1024
--h 1024 --s 30 --l 7 --d 42`: negative prompt, width, height, steps, guidance, seed), or structured:
`.toml` with `[[prompt]]` tables, `.jsonl` with one object per line, `.json` with a list of objects;
their fields are kohya's (prompt, negative_prompt, width, height, sample_steps, scale, seed) or ours
(negative, steps, guidance). Unset values come from the preview.* config.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image, ImageDraw

from ..core.config import TOMLError, parse_toml
from ..core.fsutil import atomic_save
from ..core.inject import dequantized_for_inference, merged_for_inference
from ..core.memory import first_that_fits
from ..core.speed import cudnn_search
from .baseline import previews_key
from .captions import live_text
from .memory import preview_batch
from .speed import stock_attention

log = logging.getLogger(__name__)
# What a preview set that ran out of memory does next (core/memory.first_that_fits).
LEAN_PREVIEWS = "rendering again without copies, one image at a time"


@dataclasses.dataclass
class PreviewPrompt:
    """One preview: the prompt and its own settings (None: the preview.* config's)."""
    prompt: str
    negative: str | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None

    def line(self) -> str:
        """The prompt as a line of a prompts file, with its own options (parse_prompt_line reads it back)."""
        options = {"n": self.negative, "w": self.width, "h": self.height, "s": self.steps, "l": self.guidance,
                   "d": self.seed}
        return " ".join([self.prompt, *(f"--{k} {v:g}" if isinstance(v, float) else f"--{k} {v}"
                                        for k, v in options.items() if v is not None)])


# kohya's one-letter line options -> (field, type).
_LINE_OPTIONS = {"n": ("negative", str), "w": ("width", int), "h": ("height", int), "s": ("steps", int),
                 "l": ("guidance", float), "d": ("seed", int)}
# Field names of structured entries (kohya's and ours) -> field.
_ENTRY_FIELDS = {"prompt": "prompt", "negative_prompt": "negative", "negative": "negative", "width": "width",
                 "height": "height", "sample_steps": "steps", "steps": "steps", "scale": "guidance",
                 "guidance": "guidance", "seed": "seed"}
_TYPES = {"negative": str, "width": int, "height": int, "steps": int, "guidance": float, "seed": int, "prompt": str}


def parse_prompt_line(line: str, where: str = "") -> PreviewPrompt:
    """`a cat --n blurry, lowres --w 1024 --h 768 --s 30 --l 7 --d 42` -> PreviewPrompt. Option values run
    to the next ` --x`; an unknown option is an error naming the line."""
    head, *parts = (" " + line).split(" --")
    entry = PreviewPrompt(head.strip())
    for part in parts:
        key, _, value = part.partition(" ")
        if key not in _LINE_OPTIONS:
            raise ValueError(f"{where}unknown option --{key} in {line!r}; the options are "
                             + ", ".join(f"--{k} ({f})" for k, (f, _) in _LINE_OPTIONS.items()))
        field, typ = _LINE_OPTIONS[key]
        try:
            setattr(entry, field, typ(value.strip()))
        except ValueError:
            raise ValueError(f"{where}--{key} {value.strip()!r} in {line!r}: {field} must be "
                             f"{'an integer' if typ is int else 'a number'}") from None
    if not entry.prompt:
        raise ValueError(f"{where}{line!r} has options but no prompt before them")
    return entry


def _entry(obj, where: str) -> PreviewPrompt:
    if isinstance(obj, str):
        return parse_prompt_line(obj, where)
    if not isinstance(obj, dict):
        raise ValueError(f"{where}expected a table/object with a 'prompt' field, got {obj!r}")
    unknown = sorted(set(obj) - set(_ENTRY_FIELDS))
    if unknown or "prompt" not in obj:
        raise ValueError(f"{where}" + (f"unknown field(s) {', '.join(unknown)}" if unknown else "no 'prompt' field")
                         + f"; the fields are {', '.join(_ENTRY_FIELDS)}")
    values = {}
    for k, v in obj.items():
        field = _ENTRY_FIELDS[k]
        try:
            values[field] = _TYPES[field](v)
        except (TypeError, ValueError):
            raise ValueError(f"{where}{k}={v!r} must be {_TYPES[field].__name__}") from None
    return PreviewPrompt(**values)


def read_prompts(path: str | Path | None) -> list[PreviewPrompt]:
    if not path:
        return []
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"preview.prompts={str(p)!r} does not exist; give a text file with one prompt "
                                "per line (or a .toml/.jsonl/.json file), or preview.prompts='' for no previews")
    text = p.read_text(encoding="utf-8")
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            try:
                data = parse_toml(text)
            except TOMLError as e:
                raise ValueError(f"not valid TOML: {e}") from None
            entries = data.get("prompt", data.get("prompts"))
            if not isinstance(entries, list):
                raise ValueError("expected [[prompt]] tables (each with a 'prompt' field)")
            return [_entry(e, f"[[prompt]] {i + 1}: ") for i, e in enumerate(entries)]
        if suffix == ".jsonl":
            out = []
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"line {n} is not valid JSON ({e.msg})") from None
                    out.append(_entry(obj, f"line {n}: "))
            return out
        if suffix == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno})") from None
            if not isinstance(data, list):
                raise ValueError("expected a list of objects, each with a 'prompt' field")
            return [_entry(e, f"entry {i + 1}: ") for i, e in enumerate(data)]
        return [parse_prompt_line(line.strip(), f"line {n}: ") for n, line in enumerate(text.splitlines(), 1)
                if line.strip() and not line.lstrip().startswith("#")]
    except ValueError as e:
        raise ValueError(f"preview.prompts={str(p)!r}: {e}") from None


def grid(images: list[Image.Image], cols: int | None = None, labels: list[str] | None = None) -> Image.Image:
    """The images in rows of `cols`. labels (one per image, e.g. its prompt): written above the images, once
    across a row whose images share a label (one prompt, several seeds), else above each image."""
    cols = cols or len(images)
    rows = (len(images) + cols - 1) // cols
    # Cells as large as the largest image: prompts may set their own width and height.
    w, h = max(im.size[0] for im in images), max(im.size[1] for im in images)
    bands: list[list[tuple[int, str]]] = [[] for _ in range(rows)]  # per row: (first column, label) spans
    if labels:
        for r in range(rows):
            row = labels[r * cols:(r + 1) * cols]
            bands[r] = [(0, row[0])] if len(set(row)) == 1 else list(enumerate(row))
    font = _label_font(max(10, min(w, h) // 12)) if labels else None
    wrapped = [[_wrap(text, font, (cols * w if len(b) == 1 else w) - 6) for _, text in b] for b in bands]
    line_h = (font.getbbox("Ag")[3] + 3) if font else 0
    band_h = [max((len(lines) for lines in wr), default=0) * line_h + (4 if wr else 0) for wr in wrapped]
    out = Image.new("RGB", (cols * w, rows * h + sum(band_h)), (0, 0, 0))
    draw = ImageDraw.Draw(out)
    y = 0
    for r in range(rows):
        if band_h[r]:
            draw.rectangle([0, y, cols * w - 1, y + band_h[r] - 1], fill=(255, 255, 255))
            for (col, _), lines in zip(bands[r], wrapped[r]):
                for n, line in enumerate(lines):
                    draw.text((col * w + 3, y + 2 + n * line_h), line, fill=(0, 0, 0), font=font)
        y += band_h[r]
        for c, im in enumerate(images[r * cols:(r + 1) * cols]):
            out.paste(im, (c * w, y))
        y += h
    return out


def _label_font(size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _wrap(text: str, font, width: int) -> list[str]:
    """`text` in lines no wider than `width` pixels (a word longer than that gets a line of its own)."""
    lines: list[str] = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines or [""]


# zlib's level for the previews a run writes while it trains: the run waits for their files, and level 1 writes
# them in well under half the time of Pillow's default (6) for somewhat larger files, as ComfyUI writes its
# preview images. Images a user asks for (`sdxl-lora generate`, comparisons) keep the default.
PREVIEW_PNG_LEVEL = 1


def save_png(img: Image.Image, path: Path, *, compress_level: int = 6) -> Path:
    return atomic_save(path, lambda tmp: img.save(tmp, format="PNG", compress_level=compress_level))


def _entries(prompts: list[str | PreviewPrompt]) -> list[PreviewPrompt]:
    return [p if isinstance(p, PreviewPrompt) else PreviewPrompt(p) for p in prompts]


def encode_prompts(pipe, prompts: list[str | PreviewPrompt], *, guidance: float, negative: str | None = None,
                   device=None) -> list[dict[str, torch.Tensor]]:
    """Each prompt's text embeddings as the pipeline's keyword arguments (prompt_embeds, pooled_prompt_embeds
    and, with guidance, the negative ones), computed by the pipeline's own text encoders."""
    out = []
    with torch.no_grad():
        for p in _entries(prompts):
            g = p.guidance if p.guidance is not None else guidance
            embeds = pipe.encode_prompt(prompt=p.prompt, device=device or pipe.text_encoder_2.device,
                                        num_images_per_prompt=1, do_classifier_free_guidance=g > 1,
                                        negative_prompt=p.negative if p.negative is not None else negative)
            out.append({k: v for k, v in zip(("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                                             "negative_pooled_prompt_embeds"), embeds) if v is not None})
    return out


# Prompts with the same settings render as one batch on a CPU: several images' GEMMs use the cores better than
# one image's (the same images, to float rounding). On a GPU the trainer's previews batch memory.preview_batch()
# prompts (whose UNet pass the estimate counts; each image is decoded on its own).
CPU_PREVIEW_BATCH = 8


def _batched(texts: list[dict]) -> dict:
    """Several prompts' pipeline arguments as one call's: tensors concatenated, strings listed (None where
    every one is None: render groups prompts by that)."""
    def joined(values: list):
        if isinstance(values[0], torch.Tensor):
            return torch.cat(values)
        return None if values[0] is None else values

    return {k: joined([t[k] for t in texts]) for k in texts[0]}


@dataclasses.dataclass(frozen=True)
class Sampler:
    """How every render samples, the same for a run's previews, the UI's Generate and Compare tabs and
    `sdxl-lora generate`: Euler on the base model's own schedule, with what the run's training changed in it
    (zero terminal SNR, the prediction type) and the guidance rescale that goes with it. One definition, so the
    same prompt, seed and adapter give the same pixels wherever they are rendered."""
    zero_terminal_snr: bool = False
    prediction_type: str = "auto"
    guidance_rescale: float | None = None  # None: 0.7 under zero terminal SNR (Lin et al. 2023), else none

    @classmethod
    def of_run(cls, cfg) -> "Sampler":
        """As a run's previews sample: its schedule as trained, its preview.guidance_rescale."""
        return cls(bool(cfg.train.zero_terminal_snr), cfg.model.prediction_type, cfg.preview.guidance_rescale)

    @property
    def rescale(self) -> float:
        if self.guidance_rescale is not None:
            return float(self.guidance_rescale)
        return 0.7 if self.zero_terminal_snr else 0.0

    def scheduler(self, base_config):
        return preview_scheduler(base_config, zero_terminal_snr=self.zero_terminal_snr,
                                 prediction_type=self.prediction_type)


def render(pipe, prompts: list[str | PreviewPrompt], *, seed: int, steps: int, guidance: float, width: int,
           height: int, negative: str | None = None, autocast_dtype: torch.dtype | None = None,
           sampler: Sampler | None = None, texts: list[dict[str, torch.Tensor]] | None = None,
           batch: int | None = None, progress: Callable[[int, int], None] | None = None) -> list[Image.Image]:
    """One image per prompt, each with its own settings where it has them; prompt i without its own seed
    uses seed + i, on a CPU generator, so images do not depend on the device or on how prompts are batched.
    A prompt's negative prompt unset (None) is no negative prompt, not an encoded empty one: the two differ.
    sampler: how the images are sampled (Sampler), the pipeline's scheduler swapped for the duration; None: the
    pipeline as it is (callers that built it with the sampler they want).
    texts: the prompts' embeddings (encode_prompts), made earlier; the text encoders are then not used.
    progress(done, total): told the images done as sampling goes (a batch's images count as done in step with its
    sampling steps), so a watcher sees a set of previews move, not only end.
    batch: the most prompts of the same settings rendered in one pipeline call (none: CPU_PREVIEW_BATCH on a
    CPU, one elsewhere); on a GPU a batch is decoded one image at a time, so the decode needs one image's memory."""
    device = pipe.unet.device
    ctx = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
           else contextlib.nullcontext())
    entries = _entries(prompts)
    if texts is None:
        texts = [{"prompt": p.prompt, "negative_prompt": p.negative if p.negative is not None else negative}
                 for p in entries]
    else:
        texts = [{k: v.to(device) for k, v in t.items()} for t in texts]
    limit = batch or (CPU_PREVIEW_BATCH if device.type == "cpu" else 1)
    if limit > 1 and device.type != "cpu" and not hasattr(pipe.vae, "enable_slicing"):
        limit = 1  # a VAE that cannot decode a batch one image at a time: one prompt a call keeps one decode
    slicing = limit > 1 and device.type != "cpu" and not pipe.vae.use_slicing

    def settings(i: int) -> tuple:
        p, t = entries[i], texts[i]
        return (p.steps or steps, p.guidance if p.guidance is not None else guidance, p.width or width,
                p.height or height, tuple(sorted(t)), t.get("negative_prompt") is None)

    images = []
    with torch.no_grad(), ctx, contextlib.ExitStack() as undo:
        if slicing:
            pipe.vae.enable_slicing()
            undo.callback(pipe.vae.disable_slicing)
        if sampler is not None:
            own = pipe.scheduler
            pipe.scheduler = sampler.scheduler(own.config)
            undo.callback(setattr, pipe, "scheduler", own)
        rescale = sampler.rescale if sampler is not None else 0.0
        i = 0
        while i < len(entries):
            j = i + 1
            while j < len(entries) and j - i < limit and settings(j) == settings(i):
                j += 1
            n_steps, g, w, h, _, _ = settings(i)
            gens = [torch.Generator("cpu").manual_seed(p.seed if p.seed is not None else seed + k)
                    for k, p in zip(range(i, j), entries[i:j])]
            one = j - i == 1  # a prompt alone is called as the pipeline's single-prompt call
            told = {} if progress is None else {"callback_on_step_end": _telling(progress, i, j, n_steps, len(entries))}
            out = pipe(**(texts[i] if one else _batched(texts[i:j])), num_inference_steps=n_steps, guidance_scale=g,
                       guidance_rescale=rescale, width=w, height=h, generator=gens[0] if one else gens,
                       output_type="pil", **told)
            images.extend(out.images)
            i = j
            if progress is not None:
                progress(i, len(entries))
    return images


def _telling(progress: Callable[[int, int], None], first: int, end: int, steps: int, total: int):
    """The pipeline's step callback that tells `progress` the images done while images first..end-1 sample."""
    def told(pipe, k: int, timestep, kwargs: dict) -> dict:
        progress(first + (end - first) * (k + 1) // max(steps, 1), total)
        return kwargs

    return told


def preview_scheduler(base_config, *, zero_terminal_snr: bool, prediction_type: str = "auto"):
    """The sampler for previews: Euler on the model's schedule, as trained. Under zero terminal SNR the
    betas are rescaled the same way and the timesteps spaced 'trailing', so sampling starts at the
    schedule's last (pure noise) step, as Lin et al. 2023 prescribe."""
    from diffusers import EulerDiscreteScheduler

    overrides = {}
    if prediction_type != "auto":
        overrides["prediction_type"] = prediction_type
    if zero_terminal_snr:
        overrides.update(rescale_betas_zero_snr=True, timestep_spacing="trailing")
    return EulerDiscreteScheduler.from_config(base_config, **overrides)


# preview.prompts unset, a model other than the demo base: this many of the dataset's captions.
CAPTION_PREVIEWS = 3


def default_prompts(model_path: str, items: list, captions: list[str]) -> list[PreviewPrompt]:
    """What preview.prompts unset means: for the demo base its bundled prompts (the shapes it knows and the
    star it learns); for any other model a few of the dataset's own captions, as training sees them (the
    trigger word in), spread over the dataset, all at the size of the dataset's most common bucket: prompts of
    one size render in one pipeline call on a GPU (render's batch), where one call per size would leave the GPU
    waiting on the host (benchmarks/RESULTS.md#previews-and-evaluation)."""
    from ..core.config import SAMPLE_DATA
    from .config import DEMO_NAME

    if model_path == DEMO_NAME:
        return read_prompts(SAMPLE_DATA / "prompts.txt")
    if not items:
        return []
    # The most common bucket; between equally common ones, the first in the dataset's order.
    width, height = collections.Counter(item.bucket for item in items).most_common(1)[0][0]
    seen: dict[str, PreviewPrompt] = {}
    for caption in captions:
        if caption and caption not in seen:
            seen[caption] = PreviewPrompt(caption, width=width, height=height)
    picked = list(seen.values())
    if len(picked) > CAPTION_PREVIEWS:  # evenly over the dataset, first and last included
        last = len(picked) - 1
        picked = [picked[round(i * last / (CAPTION_PREVIEWS - 1))] for i in range(CAPTION_PREVIEWS)]
    return picked


def tiled_previews(cfg) -> bool:
    """Whether previews decode in tiles: preview.vae_tiling, and always with a quantized base (a run that
    quantizes to save memory would otherwise peak at the full-size decode, not at training)."""
    return bool(cfg.preview.vae_tiling or cfg.model.quantize != "none")

@contextlib.contextmanager
def vae_tiles(vae, on: bool):
    """diffusers' tiled VAE encode and decode with VAE_DECODE_TILE-pixel tiles, for the duration (its default
    is the VAE's own sample size, 1024 for SDXL, which tiles nothing at SDXL's sizes)."""
    from .memory import VAE_DECODE_TILE as VAE_TILE

    if not on:
        yield
        return
    before = vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size = True, VAE_TILE, VAE_TILE // factor
    try:
        yield
    finally:
        vae.use_tiling, vae.tile_sample_min_size, vae.tile_latent_min_size = before


def _cached_images(store: Path, n: int) -> list[Image.Image] | None:
    """The n images an earlier run stored under `store`, or None when any of them or their grid is missing, or
    one is unreadable."""
    paths = [store / f"{i:02d}.png" for i in range(n)]
    if not all(p.is_file() for p in (*paths, store / "grid.png")):
        return None
    try:
        images = []
        for path in paths:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        return images
    except OSError:  # a damaged cache entry: render again (and store anew)
        return None


def _store_images(store: Path, run_files: list[Path], grid_file: Path) -> None:
    """The images under `store`, each written atomically (copies of the run's PNGs, the grid's too); a set cut
    short is incomplete, which _cached_images treats as absent (the next run renders and writes it again)."""
    try:
        for i, src in enumerate(run_files):
            _copy(src, store / f"{i:02d}.png")
        _copy(grid_file, store / "grid.png")
    except OSError as e:  # the cache is a convenience: a full or read-only disk loses only the reuse
        log.warning("could not store the step-0 previews in the cache (%s); the next run renders them again", e)


def _copy(src: Path, dest: Path) -> Path:
    """A PNG copied as it is: encoding a full-size image again costs far more than copying its file."""
    return atomic_save(dest, lambda tmp: shutil.copyfile(src, tmp))


@contextlib.contextmanager
def _plain_unet(model, unet, dequantized: int = 0):
    """The adapter merged into copies of the weights it adapts, its layers out of the model and the attentions on
    diffusers' own processor for the duration: the UNet runs as the bare one, without a Python call per adapted
    layer and UNet call (a preview calls the UNet at each of its sampling steps); all put back afterwards.
    dequantized: bytes of a quantized base's layers that go too, as 16-bit copies with the adapter folded in, the
    smallest first (inject.dequantized_for_inference); 0: none. Yields how many of those layers went."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(merged_for_inference(model, unwrap=True))
        copied = stack.enter_context(dequantized_for_inference(model, budget=dequantized)) if dequantized else 0
        stack.enter_context(stock_attention(unet))
        yield copied


@contextlib.contextmanager
def _told(run, step: int, n: int):
    """Yields progress(done, total) for render: a bar in the terminal and the run's phase ("rendering previews",
    done of n: Run.phase) for the UI, each written when the count of images done changes."""
    from tqdm.auto import tqdm

    run.phase("rendering previews", step, 0, n)
    bar = tqdm(total=n, desc=f"previews at step {step}", unit="img", leave=False, dynamic_ncols=True)
    shown = [0]

    def told(done: int, total: int) -> None:
        if done != shown[0]:
            shown[0] = done
            bar.update(done - bar.n)
            run.phase("rendering previews", step, done, total)

    try:
        yield told
    finally:
        bar.close()


def render_previews(task, model, run, step: int) -> list[Path]:
    """Render the task's prompts with the model being trained; the VAE and text encoders visit the
    accelerator only for the duration."""
    from diffusers import StableDiffusionXLPipeline

    cfg = task.cfg
    prompts = task.preview_prompts
    if not prompts:
        return []
    p = task.pipe
    device = task.device
    # With text encoder LoRA the model holds the UNet and the (adapted) text encoders: p's, in place.
    unet = getattr(model, "unet", model)
    # The prompts' embeddings were made at set-up (task.preview_texts) unless the text encoders train: then
    # they are encoded now, by the encoders being trained, which stay on the device anyway. With the embeddings
    # made, the pipeline gets no text encoders: it would cast the embeddings to their dtype, which is the files'
    # 16 bits where they never had to encode (SDXLTask.to_encode).
    texts = task.preview_texts
    encoders = (None, None) if texts is not None else (p.text_encoder, p.text_encoder_2)
    pipe = StableDiffusionXLPipeline(
        vae=p.vae, text_encoder=encoders[0], text_encoder_2=encoders[1], tokenizer=p.tokenizer,
        tokenizer_2=p.tokenizer_2, unet=unet, scheduler=p.scheduler)
    pipe.set_progress_bar_config(disable=True)
    # Components training still uses stay on the device afterwards.
    keep = set()
    if cfg.adapter.train_text_encoder or live_text(cfg.data):
        keep |= {id(p.text_encoder), id(p.text_encoder_2)}
    if cfg.data.crop == "random":
        keep.add(id(p.vae))
    aux = (p.vae, p.text_encoder, p.text_encoder_2)
    was_training = model.training
    model.eval()
    started = time.perf_counter()
    mp = task.accelerator.mixed_precision
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)
    key = previews_key(task) if step == 0 else None
    store = task.cache.root / "previews" / key if key else None
    images = _cached_images(store, len(prompts)) if store is not None else None
    reused = images is not None
    if reused:
        model.train(was_training)
        log.info("previews at step 0: %d images of the base from the cache (an earlier run rendered the same "
                 "base and previews: %s)", len(images), store)
        run.event("previews_reused", step=0, images=len(images), cache=str(store))
    else:
        def rendered_set(lean: bool) -> tuple[list[Image.Image], float, float, bool, int]:
            # cuDNN's algorithm search (train.* sets torch.backends.cudnn.benchmark for the training shapes)
            # would time every convolution of the pipeline at each preview size, the VAE decoder's included,
            # for a few images; its heuristics choose at no cost (speed.cudnn_search).
            # The adapter merged into copies of the weights it adapts for the set, as the tools users render with
            # apply it, and the UNet run as the bare one (_plain_unet); lean: no copies, one image a call, the
            # decode in tiles (the least memory a set can take). The VAE (and the text encoders where the prompts
            # are encoded now) visit the device inside the try: their move can run out of memory too.
            for m in ((p.vae,) if texts is not None else aux):
                m.to(device)
            merged = (contextlib.nullcontext(0) if lean
                      else _plain_unet(model, unet, dequantized=task.dequantized_previews))
            tiled = lean or tiled_previews(cfg)
            batch = 1 if lean else None if device.type == "cpu" else preview_batch(tiled)
            with cudnn_search(False), vae_tiles(p.vae, tiled), merged as copied, _told(run, step, len(prompts)) as told:
                ready = time.perf_counter()
                out = render(pipe, prompts, seed=cfg.preview.seed, steps=cfg.preview.steps,
                             guidance=cfg.preview.guidance, width=task.resolution, height=task.resolution,
                             autocast_dtype=dtype, sampler=Sampler.of_run(cfg), texts=texts, batch=batch,
                             progress=told)
                return out, ready, time.perf_counter(), lean, copied

        try:
            # A set that runs out of memory (the estimate was low, another program took memory) renders again in
            # the least memory, or not at all: previews are not what a run is for.
            done = first_that_fits([("", lambda: rendered_set(False)),
                                    (LEAN_PREVIEWS, lambda: rendered_set(True))],
                                   device=device, run=run, step=step, what="previews")
        finally:
            if device.type != "cpu":
                for m in aux:
                    if id(m) not in keep:
                        m.to("cpu")
            model.train(was_training)
        if done is None:
            return []
        images, ready, rendered, lean, copied = done
        if lean:  # not the set the step-0 cache stands for
            store = None
        # Where a set's time goes (the previews' share of a run is measured from these events, train_e2e.py).
        times = {"render_s": rendered - ready, "around_s": ready - started + time.perf_counter() - rendered}
    names = [run.samples_dir / f"step-{step:06d}-{i:02d}.png" for i in range(len(images))]
    grid_path = run.samples_dir / f"step-{step:06d}-grid.png"
    if reused:  # the cache's files as they are
        paths = [_copy(store / f"{i:02d}.png", dest) for i, dest in enumerate(names)]
        paths.append(_copy(store / "grid.png", grid_path))
    else:
        paths = [save_png(im, dest, compress_level=PREVIEW_PNG_LEVEL) for im, dest in zip(images, names)]
        # Each prompt on consecutive lines the same number of times (several seeds): one row per prompt.
        runs = {len(list(g)) for _, g in itertools.groupby(e.prompt for e in prompts)}
        cols = runs.pop() if len(runs) == 1 else None
        paths.append(save_png(grid(images, cols=cols, labels=[e.prompt for e in prompts]), grid_path,
                              compress_level=PREVIEW_PNG_LEVEL))
        if store is not None:
            _store_images(store, paths[:-1], paths[-1])
    if cfg.preview.concept:
        from .demo.shapes import report_concept

        # The step-0 preview is the base at the same seeds: what the prompts without the concept should stay close to.
        before = [run.samples_dir / f"step-{0:06d}-{i:02d}.png" for i in range(len(images))]
        baseline = [Image.open(b) for b in before] if step > 0 and all(b.is_file() for b in before) else None
        report_concept(run, step, cfg.preview.concept, [e.prompt for e in prompts], images, baseline)
    if not reused:
        seconds = time.perf_counter() - started
        times["write_s"] = seconds - times["render_s"] - times["around_s"]
        # How many quantized layers rendered from 16-bit copies: the plan's, or fewer where the GPU had less free.
        log.info("previews at step %d: %d images in %.1f s (rendering %.1f s; the VAE's moves and the adapter's "
                 "merge %.1f s; writing and scoring %.1f s)%s", step, len(images), seconds, times["render_s"],
                 times["around_s"], times["write_s"],
                 f"; {copied} quantized layers from 16-bit copies" if task.dequantized_previews else "")
        run.event("previews_rendered", step=step, images=len(images), seconds=round(seconds, 2),
                  **{k: round(v, 2) for k, v in times.items()},
                  **({"dequantized_layers": copied} if task.dequantized_previews else {}))
    return paths
