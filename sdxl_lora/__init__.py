"""sdxl_lora: LoRA and QLoRA adapters for Stable Diffusion XL and causal LMs, from one core."""
__version__ = "0.1.0"
