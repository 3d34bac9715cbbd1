"""Building blocks shared by the model files: norms, rotary embeddings, attention, routers."""
