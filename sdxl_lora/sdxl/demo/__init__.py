"""The demo: the embedded tiny SDXL, the synthetic shapes with their detector, and the demo base's
pretraining."""
