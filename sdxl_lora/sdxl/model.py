"""Load an SDXL pipeline from what the user named: the shipped demo base ("tiny-sdxl-demo"), the embedded
tiny model with random weights ("tiny-sdxl"), a diffusers folder, or a single-file .safetensors
checkpoint. Always offline; errors say which file is missing."""
from __future__ import annotations

import contextlib
import math
import os
import threading
from pathlib import Path

import torch

from ..core.weights import (PickleWeights, WeightFileError, float_dtypes, read_json, shape_problems,
                            stored_float_dtype, weight_files)
from .config import DEMO_DIR, DEMO_NAME, TINY_NAME, ModelConfig
from .demo.tiny import materialize_tiny

# diffusers folder layout of an SDXL pipeline: what must be there for from_pretrained to work.
CONFIGS = ("model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
           "text_encoder_2/config.json", "scheduler/scheduler_config.json")
REQUIRED = CONFIGS + ("tokenizer", "tokenizer_2")
# The components with weights: their library, class, and the file stem that library saves them under.
COMPONENTS = {"unet": ("diffusers", "UNet2DConditionModel", "diffusion_pytorch_model"),
              "vae": ("diffusers", "AutoencoderKL", "diffusion_pytorch_model"),
              "text_encoder": ("transformers", "CLIPTextModel", "model"),
              "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", "model")}


class ModelError(ValueError):
    pass


def resolve_model_path(cfg: ModelConfig) -> Path:
    """The diffusers folder or file the config names (materialising the tiny model if asked). The demo
    base is read where the package keeps it: nothing ever writes there."""
    if cfg.path == TINY_NAME:
        return materialize_tiny(cfg.cache_dir)
    if cfg.path == DEMO_NAME:
        if not (DEMO_DIR / "model_index.json").is_file():
            raise ModelError(f"model.path='{DEMO_NAME}': the demo base's weights are missing from {DEMO_DIR} "
                             "(they ship with the package: reinstall it, or make them with "
                             f"scripts/pretrain_demo.py, docs/demo_base.md); or use '{TINY_NAME}' (random weights)")
        return DEMO_DIR
    return Path(cfg.path).expanduser()


# A single-file checkpoint's metadata: the built-in model whose configs and tokenizers describe it (a merge
# into the demo base or tiny-sdxl writes it, sdxl/formats/merge.py); without it a single file is read as SDXL base.
CONFIGS_FROM = "sdxl_lora.configs_from"


def single_file_configs(path: Path, cfg: ModelConfig) -> Path | None:
    """The folder whose configs (and tokenizers) describe the single file at `path`: the built-in model its
    metadata names (CONFIGS_FROM); None for SDXL base's."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as fh:
            name = (fh.metadata() or {}).get(CONFIGS_FROM)
    except (SafetensorError, OSError):  # not readable as safetensors: the loader says what it is
        return None
    if name in (DEMO_NAME, TINY_NAME):
        return resolve_model_path(cfg.model_copy(update={"path": name}))
    return None


def load_pipeline(cfg: ModelConfig, torch_dtype: torch.dtype = torch.float32, unet_dtype: torch.dtype | None = None,
                  unet_device: torch.device | None = None, encoders_as_stored: bool = False):
    """The SDXL pipeline of model.path, every component in torch_dtype except the UNet where unet_dtype is
    given: training loads its frozen UNet straight in the compute dtype (half the host memory of fp32, and no
    fp32 copy of every weight made only to be cast again). unet_device: the UNet of a diffusers folder is read
    straight onto that device and cast there (a host cast of 2.6 billion weights from the file's dtype takes
    seconds; the GPU's, milliseconds). encoders_as_stored: a diffusers folder's text encoders stay in the dtype
    their checkpoints hold, for the caller to cast when it runs them (training runs them only for what its
    text cache lacks)."""
    # Belt and braces: nothing in this process may reach a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = resolve_model_path(cfg)
    if not path.exists():
        raise ModelError(f"model.path={str(path)!r} does not exist; give a diffusers SDXL folder, "
                         f"a single-file .safetensors checkpoint, '{DEMO_NAME}' or '{TINY_NAME}'")
    if path.is_file():
        if path.suffix.lower() in (".ckpt", ".pt", ".pth", ".bin"):
            raise ModelError(f"{path}: pickle checkpoints can run code when loaded and are refused; "
                             "convert it to .safetensors first")
        from .formats.single_file import load_single_file
        configs = single_file_configs(path, cfg)
        tok = Path(cfg.tokenizer) if cfg.tokenizer else configs
        pipe = load_single_file(path, tokenizer_dir=tok, config_dir=configs, torch_dtype=torch_dtype)
        if unet_dtype is not None or unet_device is not None:
            pipe.unet.to(unet_device, dtype=unet_dtype)
        return pipe
    # Each weighted component on its own, so a failure names its folder and what its library reported.
    dtypes = {name: torch_dtype for name in COMPONENTS}
    if unet_dtype:
        dtypes["unet"] = unet_dtype
    if encoders_as_stored:
        dtypes["text_encoder"] = dtypes["text_encoder_2"] = "auto"  # transformers: the checkpoint's own dtype
    reader = None
    if unet_device is not None:
        try:
            files = weight_files(path / "unet", COMPONENTS["unet"][2])
        except WeightFileError as e:
            raise _folder_error(path, e) from None
        reader = UNetReader(files, unet_device, dtypes["unet"])
    with reader if reader is not None else contextlib.nullcontext():
        from diffusers import StableDiffusionXLPipeline

        unet = check_folder(path)
        parts = {name: _load_component(path, name, dtypes[name]) for name in COMPONENTS
                 if reader is None or name != "unet"}
        if reader is not None:
            parts["unet"] = reader.into(unet, path)
    return StableDiffusionXLPipeline.from_pretrained(str(path), dtype=torch_dtype, local_files_only=True,
                                                     use_safetensors=True, **parts)


class UNetReader:
    """A diffusers folder's UNet weights read onto `device` in `dtype`, tensor by tensor, on a thread of its own
    while the caller imports the pipeline's libraries and reads the other components (`with UNetReader(...)`):
    the copies onto the device run without Python's lock, so the read costs the launch little beyond those
    imports. diffusers' own loader cannot run beside them: it builds the model under a switch of torch's that
    every thread sees (parameters made on the meta device), so the other components would be built there too."""

    def __init__(self, files: list[Path], device: torch.device, dtype: torch.dtype):
        self.files, self.device, self.dtype = files, device, dtype
        self.tensors: dict[str, torch.Tensor] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="sdxl-lora-unet-read", daemon=True)

    def __enter__(self) -> "UNetReader":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()  # an error on the caller's side: the read stops at its next tensor
        self._thread.join()
        self.tensors.clear()

    def _read(self) -> None:
        from safetensors import safe_open

        try:
            with contextlib.ExitStack() as files:
                handles = [files.enter_context(safe_open(str(f), framework="pt")) for f in self.files]
                # Each tensor goes from the file's mapped pages to the device in the file's dtype through one
                # buffer there, and is cast into its own tensor: no short-lived copy per tensor is left between
                # the weights in the allocator's memory.
                floats = float_dtypes()
                largest = max((math.prod(sl.get_shape()) * getattr(floats.get(sl.get_dtype()), "itemsize", 8)
                               for fh in handles for sl in map(fh.get_slice, fh.keys())), default=0)
                staging = torch.empty(largest, dtype=torch.uint8, device=self.device)
                for fh in handles:
                    for key in fh.keys():
                        if self._stop.is_set():
                            return
                        src = fh.get_tensor(key)
                        dst = torch.empty(src.shape, dtype=self.dtype, device=self.device)
                        if src.dtype == self.dtype:
                            dst.copy_(src)
                        else:
                            buf = staging[:src.numel() * src.element_size()].view(src.dtype).view(src.shape)
                            buf.copy_(src)
                            dst.copy_(buf)
                        self.tensors[key] = dst
        except BaseException as e:  # handed to the caller's thread, which raises it (into)
            self.error = e

    def into(self, unet: torch.nn.Module, path: Path) -> torch.nn.Module:
        """`unet` (check_folder's, on the meta device: its tensors' shapes checked against the files' headers)
        with the weights read, as diffusers' loader leaves it: in eval mode, its config naming the folder."""
        from safetensors import SafetensorError

        self._thread.join()
        if isinstance(self.error, (SafetensorError, OSError)):
            raise _folder_error(path, f"{path / 'unet'} could not be read: {self.error}") from None
        if self.error is not None:
            raise self.error
        expected = unet.state_dict().keys()
        unet.load_state_dict({k: self.tensors[k] for k in expected}, strict=True, assign=True)
        unet.register_to_config(_name_or_path=str(path))
        return unet.eval()


def stored_unet_dtype(cfg: ModelConfig) -> torch.dtype | None:
    """The dtype a diffusers folder's UNet weights are stored in (from the files' headers); None for a
    single-file checkpoint, or weights stored in several dtypes."""
    path = resolve_model_path(cfg)
    if not path.is_dir():
        return None
    return stored_float_dtype(weight_files(path / "unet", COMPONENTS["unet"][2]))


def _folder_error(path: Path, problem: str | WeightFileError) -> ModelError:
    if isinstance(problem, PickleWeights):  # its message says what to do
        return ModelError(str(problem))
    return ModelError(f"{problem}. {path} is not a usable diffusers SDXL folder: copy it again, whole, from where "
                      f"it came from, or give another model (a single-file .safetensors checkpoint, '{DEMO_NAME}')")


def check_folder(path: Path):
    """Check a diffusers SDXL folder before anything loads from it, and return its UNet on the meta device.
    Every config parses, model_index.json names SDXL's components, each component's weights are whole
    safetensors files (pickles are refused), and the UNet's tensors have the shapes its config.json gives
    (read from the file headers: no weights are loaded)."""
    missing = [r for r in REQUIRED if not (path / r).exists()]
    if missing:
        raise ModelError(f"{path} is not a diffusers SDXL folder: missing {', '.join(missing)}")
    try:
        configs = {name: read_json(path / name) for name in CONFIGS}
        absent = [c for c in (*COMPONENTS, "scheduler", "tokenizer", "tokenizer_2")
                  if c not in configs["model_index.json"]]
        if absent:
            raise WeightFileError(f"{path / 'model_index.json'} names no {', '.join(absent)} (an SDXL pipeline's "
                                  "index names unet, vae, text_encoder, text_encoder_2, tokenizers and scheduler)")
        files = {name: weight_files(path / name, stem) for name, (_, _, stem) in COMPONENTS.items()}
        unet = _meta_unet(configs["unet/config.json"], path / "unet" / "config.json")
        problems = shape_problems(files["unet"], {k: tuple(v.shape) for k, v in unet.state_dict().items()})
    except WeightFileError as e:
        raise _folder_error(path, e) from None
    if problems:
        where = files["unet"][0] if len(files["unet"]) == 1 else path / "unet"
        raise _folder_error(path, f"{where} does not hold the UNet unet/config.json describes: "
                                  f"{'; '.join(problems)} (weights of another model, or a damaged file)")
    return unet


def _meta_unet(config: dict, where: Path):
    """The UNet `config` describes, on the meta device (structure only)."""
    from diffusers import UNet2DConditionModel

    try:
        with torch.device("meta"):
            return UNet2DConditionModel.from_config(config)
    except (TypeError, ValueError, KeyError) as e:  # a config whose values do not make a UNet
        raise WeightFileError(f"{where} does not describe a UNet diffusers can build ({e})") from None


def _load_component(path: Path, name: str, torch_dtype: torch.dtype | str, device: torch.device | None = None):
    """One weighted component of the folder (COMPONENTS), refused unless every weight came from its file;
    read onto `device` where one is given (the host otherwise)."""
    import importlib

    library, cls_name, _ = COMPONENTS[name]
    cls = getattr(importlib.import_module(library), cls_name)
    placed = {"device_map": {"": device}} if device is not None else {}
    try:
        model, info = cls.from_pretrained(str(path), subfolder=name, dtype=torch_dtype, local_files_only=True,
                                          use_safetensors=True, output_loading_info=True, **placed)
    except (OSError, ValueError, RuntimeError) as e:  # the library's word on weights that do not fit
        cause = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise _folder_error(path, f"{path / name} could not be loaded as the {cls_name} its config.json "
                                  f"describes: {cause}") from None
    missing = sorted(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if missing or mismatched:
        shown = ", ".join(str(k) for k in (missing or mismatched)[:2])
        raise _folder_error(path, f"{path / name} does not hold the {cls_name} its config.json describes: "
                                  f"{len(missing)} tensors missing, {len(mismatched)} of another shape (e.g. {shown})")
    if placed:
        # A one-device map leaves the model as a plain one on that device; the attribute would tell peft and
        # Accelerate that it is dispatched over several.
        model.__dict__.pop("hf_device_map", None)
    return model


def native_resolution(pipe) -> int:
    return int(pipe.unet.config.sample_size) * int(pipe.vae_scale_factor)


ARCH_SDXL = "arch:sdxl"


def unet_skeleton(cfg: ModelConfig):
    """The model's UNet on the meta device (structure only: no memory, no weights read), and its
    native resolution. `arch:sdxl` is SDXL base's own config, bundled with the package. A diffusers folder
    is checked as training would load it (check_folder: configs, and the weight files' headers)."""
    from .formats.single_file import SDXL_BASE_CONFIG_DIR

    path = SDXL_BASE_CONFIG_DIR if cfg.path == ARCH_SDXL else resolve_model_path(cfg)
    if path.is_file():  # a single-file checkpoint is read as its loading reads it: SDXL base, or what it names
        path = single_file_configs(path, cfg) or SDXL_BASE_CONFIG_DIR
    if not (path / "unet" / "config.json").is_file():
        raise ModelError(f"{path} has no unet/config.json; give a diffusers SDXL folder, "
                         f"a single-file checkpoint, '{DEMO_NAME}', '{TINY_NAME}' or '{ARCH_SDXL}'")
    try:
        if path == SDXL_BASE_CONFIG_DIR:
            unet = _meta_unet(read_json(path / "unet" / "config.json"), path / "unet" / "config.json")
        else:
            unet = check_folder(path)
        vae_factor = 2 ** (len(read_json(path / "vae" / "config.json")["block_out_channels"]) - 1)
    except WeightFileError as e:
        raise _folder_error(path, e) from None
    return unet, int(unet.config.sample_size) * vae_factor
