"""The SDXL task: model loading, data, caches, loss and previews."""
