"""The tiny SDXL's pipeline and its UNet's fixed inputs and outputs, shared by the tests that compare an adapter's
effect."""
import torch


def inputs(unet):
    """Two samples at 8x8 latents with seeded text embeddings and time ids, one early and one late timestep."""
    cfg = unet.config
    g = torch.Generator().manual_seed(11)
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    return dict(sample=torch.randn(2, 4, 8, 8, generator=g), timestep=torch.tensor([10, 700]),
                encoder_hidden_states=torch.randn(2, 77, cfg.cross_attention_dim, generator=g),
                added_cond_kwargs={"text_embeds": torch.randn(2, pooled, generator=g),
                                   "time_ids": torch.randn(2, 6, generator=g)})


@torch.no_grad()
def out(unet, inputs):
    return unet(**inputs).sample


def fresh_unet(tiny_dir):
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel.from_pretrained(str(tiny_dir / "unet"))


def pipe(tiny_dir):
    """The tiny SDXL pipeline from its folder, diffusers' own loader, progress bars off."""
    from diffusers import StableDiffusionXLPipeline
    p = StableDiffusionXLPipeline.from_pretrained(str(tiny_dir), local_files_only=True)
    p.set_progress_bar_config(disable=True)
    return p
