"""The causal-LM task: model loading, chat/instruction data, packing, masking, loss, previews, adapter export."""
